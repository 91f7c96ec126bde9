"""The page's own CSS and script (`app.server` hands them to Gradio's launch): one streaming control
that Escape presses, and a layout that works at a phone's width."""

from __future__ import annotations

from app.composer import STOP_CLASS
from app.sidebar import SIDEBAR_CLASS, TOGGLE_CLASS

PHONE_PX = 700  # narrower than this, the sidebar folds behind its button

CSS = f"""
.{TOGGLE_CLASS} {{ display: none !important; }}
#models-table {{ max-width: 100%; overflow-x: auto; }}
@media (max-width: {PHONE_PX}px) {{
  .{TOGGLE_CLASS} {{ display: block !important; flex-grow: 0 !important; }}
  .{SIDEBAR_CLASS}:not(.open) {{ display: none !important; }}
  #heading h2 {{ font-size: 1.1em; margin: 0; }}
  #tools-status, #chat-model-notice, .studio-banner {{ font-size: 0.8em; }}
}}
"""

HEAD = f"""<script>
document.addEventListener("keydown", (event) => {{
  // Escape stops the reply streaming in the tab shown (the Stop button takes Send's place meanwhile).
  if (event.key !== "Escape") return;
  const stop = [...document.querySelectorAll(".{STOP_CLASS}")].find((b) => b.offsetParent !== null);
  if (stop) {{ stop.click(); event.preventDefault(); }}
}});
window.addEventListener("load", () => {{
  // The message box takes the focus on a wide screen only: on a phone that would scroll the tabs away.
  if (window.innerWidth > {PHONE_PX}) setTimeout(() => document.querySelector("#chat-input textarea")?.focus(), 500);
}});
</script>"""
