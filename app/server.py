"""The browser app and the OpenAI-compatible API on one port, and the serving loop (`launch.py` runs it)."""

from __future__ import annotations

import argparse
import sys
import time

from pipeline.errors import UserError
from pipeline.service.studio import StudioService

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def start_server(args: argparse.Namespace, service: StudioService):
    """The UI and the OpenAI-compatible API on one port, serving in the background: (app, url)."""
    import secrets

    from app.openai_api import mount
    from app.ui import build_app

    auth = None
    if args.auth:
        auth = [entry.partition(":")[::2] for entry in args.auth]
        if not all(user and password for user, password in auth):
            raise UserError("--auth must look like user:password, both non-empty")
        if len({user for user, _ in auth}) < len(auth):
            raise UserError("--auth names a user twice")
    if args.max_sessions < 1 or args.session_idle < 1:
        raise UserError("--max-sessions and --session-idle must be at least 1")
    api_key = args.api_key
    if api_key is None and args.host not in LOOPBACK:
        api_key = secrets.token_urlsafe(24)
        print(f"[studio] the API is reachable from other machines: its key is {api_key} "
              f"(Authorization: Bearer …; set your own with --api-key)", flush=True)
    app = build_app(service, args.keep_files).queue(default_concurrency_limit=1)
    server, local_url, share_url = app.launch(server_name=args.host, server_port=args.port, share=args.share,
                                              auth=auth, show_error=True, prevent_thread_lock=True, quiet=True,
                                              max_file_size=args.max_upload,
                                              state_session_capacity=args.max_sessions)
    mount(server, service, api_key, args.allow_file_urls)
    url = share_url or local_url
    print(f"[studio] ready: {url} (OpenAI-compatible API at {local_url.rstrip('/')}/v1) · Ctrl+C to stop", flush=True)
    return app, url


def serve(args: argparse.Namespace, service: StudioService) -> int:
    """`start_server`, then: the browser opened when run from a terminal; idle sessions dropped every
    minute; Ctrl+C shuts down cleanly (engines stopped, caches untouched)."""
    import webbrowser

    from app.sessions import forget_idle_sessions

    app, url = start_server(args, service)
    if not args.no_browser and sys.stdout.isatty():
        webbrowser.open(url)
    swept = time.monotonic()
    try:
        while app.is_running:
            time.sleep(0.2)
            if time.monotonic() - swept > 60:
                forget_idle_sessions(app, args.session_idle)
                swept = time.monotonic()
    except KeyboardInterrupt:
        print("\n[studio] shutting down…", flush=True)
    finally:
        app.close()
        service.close()
    return 0
