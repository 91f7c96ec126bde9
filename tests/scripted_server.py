"""A chat server that answers every request with one scripted reply, streamed a few characters at a time in
OpenAI's format, and keeps each request's messages: what `--llm-endpoint` talks to when a test needs to know what
the model says (a citation to a source that was given, one that was not) and what it was asked."""

from __future__ import annotations

import contextlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Scripted:
    def __init__(self, reply: str):
        self.reply, self.asked = reply, []

    @contextlib.contextmanager
    def serving(self):
        """Yields the server's /v1 URL."""
        scripted = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _send(self, body: bytes, kind: str) -> None:
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                self._send(json.dumps({"object": "list", "data": [{"id": "scripted", "object": "model"}]}).encode(),
                           "application/json")

            def do_POST(self) -> None:
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                scripted.asked.append(request["messages"])
                pieces = [scripted.reply[i:i + 3] for i in range(0, len(scripted.reply), 3)]
                chunks = [{"choices": [{"index": 0, "delta": {"content": p}, "finish_reason": None}]} for p in pieces]
                chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
                self._send("".join(f"data: {json.dumps(c)}\n\n" for c in chunks).encode() + b"data: [DONE]\n\n",
                           "text/event-stream")

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            yield f"http://127.0.0.1:{server.server_port}/v1"
        finally:
            server.shutdown()
