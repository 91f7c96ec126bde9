"""The page's own CSS and script (`app.server` hands them to Gradio's launch): one streaming control
that Escape presses, a message box a reply never takes over (Enter while it streams keeps the message
there and says why; Send stays off while the box is empty), voice mode's hands-free listening
(`voice_mode.js`), and a layout that works at a phone's width."""

from __future__ import annotations

import json
from pathlib import Path

import gradio as gr

from app.composer import BUSY_HINT, COMPOSERS, STOP_CLASS
from app.sidebar import ACTIONS_CLASS, LIST_CLASS, SIDEBAR_CLASS, TOGGLE_CLASS

PHONE_PX = 700  # narrower than this, the sidebar folds behind its button
# Math in replies as chat users write it: $$…$$ and \[…\] on a line of their own, $…$ and \(…\) inline.
LATEX = [{"left": "$$", "right": "$$", "display": True}, {"left": "\\[", "right": "\\]", "display": True},
         {"left": "$", "right": "$", "display": False}, {"left": "\\(", "right": "\\)", "display": False}]
# The page follows the system's light or dark mode (Gradio's default); this button flips it for the visit.
DARK_TOGGLE_JS = "() => document.body.classList.toggle('dark')"

# What a screen reader hears as an event ends: Gradio's frontend says "common.complete", a key missing from
# its own English strings; ours fills it (in every language: the others fall back to English).
SPOKEN = gr.I18n(en={"common.complete": "Done"})

LIST_HEIGHT = "40vh"  # a long conversation list scrolls in its own box; the actions under it stay in view
# A chat pane's messages scroll below its label and icons (trash, copy all), never under them: Gradio lays
# those over the top of the scrolling area, where the question it scrolls to the top would sit.
CHAT_PANE_CLASS = "studio-chat-pane"
# The chat pane takes the window's height less the header and the message box, status line, Regenerate and
# Edit under it, so those stay in view on a laptop's screen (1440 × 900) without scrolling; on a narrow
# screen less again, where the status line wraps to several lines (a phone: its floor, 280 px)
CHAT_PANE_HEIGHT = "max(280px, calc(100vh - 480px - max(0px, 700px - 100vw) * 0.3))"
PANE_BAR = "30px"

CSS = f"""
.{TOGGLE_CLASS} {{ display: none !important; }}
.{SIDEBAR_CLASS} .{LIST_CLASS} {{ max-height: {LIST_HEIGHT}; overflow-y: auto; flex-wrap: nowrap; }}
/* Rename and Delete only while a conversation is open: on a fresh page they would have nothing to act on */
.{SIDEBAR_CLASS}:not(:has(.{LIST_CLASS} input:checked)) .{ACTIONS_CLASS} {{ display: none !important; }}
.{CHAT_PANE_CLASS} .bubble-wrap {{ margin-top: {PANE_BAR}; height: calc(100% - {PANE_BAR}) !important; }}
/* one way to delete a conversation, the sidebar's Delete (with Undo): not Gradio's own trash icon beside it */
.{CHAT_PANE_CLASS} button[aria-label="Clear"] {{ display: none; }}
/* a reply's menu holds one entry, Read aloud (`composer.reply_menu`): its button shows a speaker, not a flag */
.{CHAT_PANE_CLASS} button[aria-label="Feedback"] svg {{ display: none; }}
.{CHAT_PANE_CLASS} button[aria-label="Feedback"]::after {{ content: "🔊"; font-size: 0.9em; }}
#theme-toggle {{ align-self: flex-start; }}  /* a button's height, beside a heading that wraps on a phone */
#models-table {{ max-width: 100%; overflow-x: auto; }}
@media (max-width: {PHONE_PX}px) {{
  .{TOGGLE_CLASS} {{ display: block !important; flex-grow: 0 !important; }}
  .{SIDEBAR_CLASS}:not(.open) {{ display: none !important; }}
  #heading h2 {{ font-size: 1.1em; margin: 0; }}
  .studio-subtitle, .studio-more {{ display: none; }}  /* the heading's and the notices' first words only */
  #chat-model-notice, .studio-banner {{ font-size: 0.8em; }}
  #tools-status {{ display: none !important; }}  /* the engine details: in the start-up panel on a phone */
}}
"""

VOICE_MODE = (Path(__file__).parent / "voice_mode.js").read_text(encoding="utf-8")
HEAD = f"""<script>
document.addEventListener("keydown", (event) => {{
  // Escape stops the reply streaming in the tab shown (the Stop button takes Send's place meanwhile).
  if (event.key !== "Escape") return;
  const stop = [...document.querySelectorAll(".{STOP_CLASS}")].find((b) => b.offsetParent !== null);
  if (stop) {{ stop.click(); event.preventDefault(); }}
}});
const composers = {json.dumps(list(COMPOSERS))};
const shown = (el) => el && el.offsetParent !== null;
document.addEventListener("keydown", (event) => {{
  // Enter while a reply streams: the message stays in the box (not sent, not lost), and a line says why.
  if (event.key !== "Enter" || event.shiftKey || event.isComposing) return;
  const prefix = composers.find((p) => event.target.closest?.(`#${{p}}-input`));
  if (!prefix || !shown(document.getElementById(`${{prefix}}-stop`))) return;
  event.preventDefault();
  event.stopImmediatePropagation();
  const hint = document.getElementById(`${{prefix}}-hint`);
  hint.textContent = {json.dumps(BUSY_HINT)};
  const watch = setInterval(() => {{
    if (!shown(document.getElementById(`${{prefix}}-stop`))) {{ hint.textContent = ""; clearInterval(watch); }}
  }}, 300);
}}, true);
setInterval(() => {{
  // Send is off while its box is empty (however the box was emptied: typing, sending, a new chat).
  for (const prefix of composers) {{
    const box = document.querySelector(`#${{prefix}}-input textarea`);
    const send = document.getElementById(`${{prefix}}-send`);
    if (box && send) send.disabled = !box.value.trim();
  }}
}}, 250);
{VOICE_MODE}
window.addEventListener("load", () => {{
  // The message box takes the focus on a wide screen only: on a phone that would scroll the tabs away.
  if (window.innerWidth > {PHONE_PX}) setTimeout(() => document.querySelector("#chat-input textarea")?.focus(), 500);
}});
</script>"""
