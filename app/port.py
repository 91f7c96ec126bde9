"""The serving port, checked before anything loads: a taken port was found only after the chat model
had loaded (28 s), as a 25-line Gradio traceback."""

from __future__ import annotations

import errno
import socket

from pipeline.errors import UserError


def check_port_free(host: str, port: int) -> None:
    """A `UserError` naming `--port` when the server could not listen on `host`:`port`. Bound the way the
    server binds (SO_REUSEADDR: a closed connection's TIME_WAIT does not block it, a listener does)."""
    if not 0 <= port < 65536:
        raise UserError(f"--port {port}: give a port from 1 to 65535 (0: any free one)")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise UserError(f"--host {host}: not an address of this machine ({e.strerror})") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise UserError(f"port {port} on {host} is taken (another AI Studio, or another server): "
                                f"stop it, or choose a free port with --port {port + 1}") from None
            raise UserError(f"cannot serve on {host}:{port} ({e.strerror}): choose another --host or --port") from None
