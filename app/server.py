"""The browser app and the OpenAI-compatible API on one port, and the serving loop (`launch.py` runs it)."""

from __future__ import annotations

import faulthandler
import os
import secrets
import signal
import sys
import threading
import time
import webbrowser

from app.documents_route import mount_documents
from app.speech_route import mount_speech
from app.downloads import keep_files_for
from app.openai_api import mount
from app.page_style import CSS, HEAD, SPOKEN
from app.sessions import forget_idle_sessions
from app.ui import build_app
from pipeline.service.studio import StudioService
from studio.config import StudioConfig

LOOPBACK = ("127.0.0.1", "localhost", "::1")
STOP_WITHIN_S = 20  # after Ctrl+C, the most a clean shutdown may take before the process stops anyway


def start_server(config: StudioConfig, service: StudioService):
    """The UI and the OpenAI-compatible API on one port, serving in the background: (app, url)."""
    auth = list(config.auth) or None
    api_key = config.api_key
    if api_key is None and config.host not in LOOPBACK:
        api_key = secrets.token_urlsafe(24)
        print(f"[studio] the API is reachable from other machines: its key is {api_key} "
              f"(Authorization: Bearer …; set your own with --api-key)", flush=True)
    keep_files_for(config.keep_files)
    app = build_app(service, config.keep_files).queue(default_concurrency_limit=1)
    server, local_url, share_url = app.launch(server_name=config.host, server_port=config.port, share=config.share,
                                              auth=auth, show_error=True, prevent_thread_lock=True, quiet=True,
                                              css=CSS, head=HEAD, i18n=SPOKEN,
                                              max_file_size=config.max_upload,
                                              state_session_capacity=config.max_sessions)
    mount(server, service, api_key, config.allow_file_urls)
    mount_documents(server, service)
    mount_speech(server, service)
    url = share_url or local_url
    print(f"[studio] ready: {url} (OpenAI-compatible API at {local_url.rstrip('/')}/v1) · Ctrl+C to stop", flush=True)
    return app, url


def stop_for_sure(seconds: float) -> None:
    """Ctrl+C (or SIGTERM) always ends the process: `seconds` after the signal arrives, if a clean shutdown
    has not ended it, every thread's stack goes to stderr (to see what held it) and the process exits.
    The signal is seen through the wakeup fd, written by the C-level handler at once, so this holds even
    when the main thread is busy and no Python handler runs yet. Caches and the conversation database
    are written atomically or journaled: stopping at any point loses nothing committed. (SIGINT raises
    KeyboardInterrupt from the start-up on, whatever the process inherited: `studio.compose.configure_process`.)"""
    heard, wake = os.pipe()
    os.set_blocking(wake, False)
    signal.set_wakeup_fd(wake)

    def watch() -> None:
        os.read(heard, 1)
        time.sleep(seconds)
        print(f"[studio] still shutting down {seconds:.0f} s after Ctrl+C: stopping now (each thread's stack "
              f"follows)", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(all_threads=True)
        os._exit(1)

    threading.Thread(target=watch, name="stop-for-sure", daemon=True).start()


def serve(config: StudioConfig, service: StudioService) -> int:
    """`start_server`, then: the browser opened when run from a terminal; idle sessions dropped every
    minute; Ctrl+C shuts down cleanly (engines stopped, caches untouched), and in any case within
    `STOP_WITHIN_S`."""
    stop_for_sure(STOP_WITHIN_S)
    app = None
    try:  # from the start: a Ctrl+C right after the ready line must still shut the server down
        app, url = start_server(config, service)
        if not config.no_browser and sys.stdout.isatty():
            webbrowser.open(url)
        swept = time.monotonic()
        while app.is_running:
            time.sleep(0.2)
            if time.monotonic() - swept > 60:
                forget_idle_sessions(app, config.session_idle)
                swept = time.monotonic()
    except KeyboardInterrupt:
        print("\n[studio] shutting down…", flush=True)
    finally:
        if app is not None:
            app.close()
        service.close()
    return 0
