"""A local stand-in for the Hugging Face hub, speaking the part of its HTTP protocol that
huggingface_hub's own client uses to download a model (`HF_ENDPOINT=http://127.0.0.1:PORT`):

- `GET /api/models/{repo}/revision/{rev}`: the repo's commit and files (404 + `X-Error-Code:
  RepoNotFound` for an unknown repo, as the hub answers);
- `GET /api/models/{repo}/tree/{commit}`: the files with their sizes and blob ids;
- `HEAD`/`GET /{repo}/resolve/{rev}/{file}`: the file, with `X-Repo-Commit`, `ETag`, and `Range`
  requests answered `206` (how the client resumes a partial file).

Files are sent in chunks `delay_s` apart, so a test sees progress and can interrupt a download; the
first download of each file named in `drop_once` is cut off halfway (the connection closed), as a
flaky network would.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import socket
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

CHUNK = 16 << 10


class Hub(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, repos: dict[str, Path], delay_s: float = 0.0, drop_once: tuple[str, ...] = ()):
        """`repos`: repo id → a folder whose files the repo holds."""
        super().__init__(("127.0.0.1", 0), Handler)
        self.repos = {repo: {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
                             if p.is_file()} for repo, folder in repos.items()}
        self.commits = {repo: hashlib.sha1(repo.encode()).hexdigest() for repo in repos}
        self.delay_s = delay_s
        self.drop_once = set(drop_once)
        self.ranges: list[tuple[str, str | None]] = []  # (file, Range header) of every GET of a file

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    server: Hub

    def log_message(self, *args) -> None:
        pass

    def _json(self, body: object, status: int = 200, headers: dict | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _not_found(self) -> None:
        self._json({"error": "Repository not found"}, 404, {"X-Error-Code": "RepoNotFound",
                                                             "X-Error-Message": "Repository not found"})

    def _split(self, path: str, marker: str) -> tuple[str, str] | None:
        """(repo id, the rest) of `/…{repo}/{marker}/{rest}`, if `repo` is one the hub has."""
        for repo in self.server.repos:
            prefix = f"{repo}/{marker}/"
            if path.startswith(prefix):
                return repo, path[len(prefix):]
        return None

    def do_GET(self) -> None:
        self._serve(body=True)

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def _serve(self, body: bool) -> None:
        path = urllib.parse.unquote(urllib.parse.urlparse(self.path).path).lstrip("/")
        if path.startswith("api/models/"):
            path = path[len("api/models/"):]
            if found := self._split(path, "revision"):
                repo = found[0]
                files = self.server.repos[repo]
                return self._json({"id": repo, "modelId": repo, "sha": self.server.commits[repo], "private": False,
                                   "siblings": [{"rfilename": f} for f in files]})
            if found := self._split(path, "tree"):
                files = self.server.repos[found[0]]
                return self._json([{"type": "file", "path": f, "size": len(data),
                                    "oid": hashlib.sha1(data).hexdigest()} for f, data in files.items()])
            return self._not_found()
        found = self._split(path, "resolve")
        if not found:
            return self._not_found()
        repo, rest = found
        name = rest.split("/", 1)[1] if "/" in rest else ""
        data = self.server.repos[repo].get(name)
        if data is None:
            return self._json({"error": "Entry not found"}, 404, {"X-Error-Code": "EntryNotFound"})
        start = 0
        wanted = self.headers.get("Range")
        if body:
            self.server.ranges.append((name, wanted))
        if wanted and wanted.startswith("bytes="):
            start = int(wanted[6:].split("-")[0])
        self.send_response(206 if start else 200)
        self.send_header("Content-Length", str(len(data) - start))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("X-Repo-Commit", self.server.commits[repo])
        self.send_header("ETag", f'"{hashlib.sha1(data).hexdigest()}"')
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        if not body:
            return
        end = len(data)
        if name in self.server.drop_once:
            self.server.drop_once.discard(name)
            end = len(data) // 2
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            for at in range(start, end, CHUNK):
                self.wfile.write(data[at:min(at + CHUNK, end)])
                self.wfile.flush()
                time.sleep(self.server.delay_s)
            if end < len(data):
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)
                self.close_connection = True


@contextlib.contextmanager
def serving(repos: dict[str, Path], delay_s: float = 0.0, drop_once: tuple[str, ...] = ()):
    hub = Hub(repos, delay_s, drop_once)
    thread = threading.Thread(target=hub.serve_forever, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        hub.shutdown()
        hub.server_close()
