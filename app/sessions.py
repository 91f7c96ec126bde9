"""Per-session memory that ends: Gradio keeps a `SessionState` for every session hash it has seen
(a browser tab, a `gradio_client`, an API call), and each holds a copy of the whole UI's
configuration (~180 KB for this app) until 10,000 sessions have been seen: 1.8 GB that a script
opening fresh clients fills. `--max-sessions` lowers that cap (Gradio's `state_session_capacity`,
least recently used first), and `forget_idle_sessions` drops the sessions idle longer than
`--session-idle`, as the Segment tab's own state already expires.

What a dropped session loses: only server-side state (the Segment tab's photo and prompts). Chat and
image-chat histories live in the browser and come with every request.
"""

from __future__ import annotations

import datetime

import gradio as gr


def forget_idle_sessions(blocks: gr.Blocks, idle_s: float) -> int:
    """Drop every session idle for at least `idle_s` seconds (their states' delete callbacks run);
    the number dropped. A dropped session that comes back gets a fresh one."""
    holder = blocks.state_holder
    cutoff = datetime.datetime.now() - datetime.timedelta(seconds=idle_s)
    with holder.lock:
        idle = [session for session, last in holder.time_last_used.items() if last <= cutoff]
    for session in idle:
        holder.delete_state(session)
        with holder.lock:
            holder.session_data.pop(session, None)
            holder.time_last_used.pop(session, None)
    return len(idle)
