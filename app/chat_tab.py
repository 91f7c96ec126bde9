"""The Chat tab: wiring between Gradio components and `ChatPipeline` (no model logic here)."""

from __future__ import annotations

import threading

import gradio as gr

from pipeline.chat import ChatPipeline
from pipeline.errors import UserError
from pipeline.llm.sampling import SamplingParams

DEFAULT_SYSTEM = "You are a helpful assistant."


def _text(content) -> str:
    """Gradio 6 hands message content over as a list of parts; keep the text ones."""
    if isinstance(content, str):
        return content
    parts = content if isinstance(content, list) else [content]
    return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in parts)


class CancelFlags:
    """One cancel flag per browser session, so Stop ends only that session's reply."""

    def __init__(self):
        self._flags: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def fresh(self, session: str) -> threading.Event:
        with self._lock:
            self._flags[session] = threading.Event()
            return self._flags[session]

    def cancel(self, session: str) -> None:
        with self._lock:
            flag = self._flags.get(session)
        if flag is not None:
            flag.set()


def _stats_line(stats) -> str:
    return (f"{stats.new_tokens} tokens · {stats.tokens_per_s:.1f} tok/s · first token "
            f"{stats.time_to_first_token_s * 1000:.0f} ms · prompt {stats.prompt_tokens} tokens · "
            f"ended: {stats.finish_reason}")


def build_chat_tab(pipeline: ChatPipeline, app: gr.Blocks, storage_secret: str) -> None:
    """`storage_secret` encrypts the conversation kept in the browser's localStorage, so a reload or
    an app restart does not lose it (the secret must outlive the process for the latter)."""
    flags = CancelFlags()

    def respond(message: str, history: list, system_prompt: str, temperature: float, top_p: float, top_k: int,
                repetition_penalty: float, max_new_tokens: int, seed: int, request: gr.Request):
        """Stream a reply to `message`; yields (textbox, chat history, status). Seed -1 = random."""
        try:
            params = SamplingParams(max_new_tokens=int(max_new_tokens), temperature=float(temperature),
                                    top_p=float(top_p), top_k=int(top_k),
                                    repetition_penalty=float(repetition_penalty),
                                    seed=None if seed is None or int(seed) < 0 else int(seed)).validated()
            if not isinstance(message, str) or not message.strip():
                raise UserError("the message is empty: type something to send")
        except (UserError, TypeError, ValueError) as e:
            raise gr.Error(str(e)) from None
        history = [{"role": m["role"], "content": _text(m["content"])} for m in history or []]
        system = [{"role": "system", "content": system_prompt}] if system_prompt and system_prompt.strip() else []
        messages = system + history + [{"role": "user", "content": message}]
        history = history + [{"role": "user", "content": message}, {"role": "assistant", "content": ""}]
        notices: list[str] = []
        cancel = flags.fresh(request.session_hash or "")
        try:
            for event in pipeline.stream(messages, params, cancel=cancel):
                if event.notice:
                    notices.append(event.notice)
                    gr.Warning(event.notice)
                history[-1]["content"] += event.text
                status = _stats_line(event.stats) if event.stats else "generating…"
                yield "", history, " · ".join(notices + [status])
        except UserError as e:
            raise gr.Error(str(e)) from None

    with gr.Row():
        with gr.Column(scale=4):
            chatbot = gr.Chatbot(label="Chat", height=520, buttons=["copy", "copy_all"])
            with gr.Row():
                message = gr.Textbox(placeholder="Type a message, Enter to send", show_label=False, scale=6,
                                     autofocus=True)
                send = gr.Button("Send", variant="primary", scale=1)
            with gr.Row():
                stop = gr.Button("Stop")
                clear = gr.Button("New chat")
            status = gr.Markdown("")
        with gr.Column(scale=2):
            system_prompt = gr.Textbox(DEFAULT_SYSTEM, label="System prompt", lines=3)
            with gr.Accordion("Sampling", open=True):
                temperature = gr.Slider(0, 2, value=0.7, step=0.05, label="Temperature (0 = greedy)")
                top_p = gr.Slider(0.05, 1, value=0.8, step=0.05, label="Top-p")
                top_k = gr.Slider(0, 200, value=20, step=1, label="Top-k (0 = off)")
                repetition_penalty = gr.Slider(1.0, 2.0, value=1.05, step=0.01, label="Repetition penalty")
                max_new_tokens = gr.Slider(1, 4096, value=512, step=1, label="Max new tokens")
                seed = gr.Number(-1, precision=0, label="Seed (-1 = random)")

    saved = gr.BrowserState([], storage_key="ai-studio-chat", secret=storage_secret)
    inputs = [message, chatbot, system_prompt, temperature, top_p, top_k, repetition_penalty, max_new_tokens, seed]
    outputs = [message, chatbot, status]
    keep = dict(fn=lambda history: history, inputs=chatbot, outputs=saved, api_visibility="private")
    on_enter = message.submit(respond, inputs, outputs, api_name="chat", concurrency_limit=1)
    on_send = send.click(respond, inputs, outputs, api_visibility="private", concurrency_limit=1)
    on_enter.then(**keep)
    on_send.then(**keep)

    def stop_reply(request: gr.Request) -> str:
        flags.cancel(request.session_hash or "")
        return "Stopped: the reply so far is kept."

    stop.click(stop_reply, None, status, cancels=[on_enter, on_send], api_name="stop").then(**keep)
    clear.click(lambda: ([], "", ""), None, [chatbot, message, status], api_visibility="private").then(**keep)
    app.load(lambda history: history, saved, chatbot, api_visibility="private")
