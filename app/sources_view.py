"""A reply's document sources under it in the chat pane: a box (closed, its line naming each source) that opens on
each source's passage and the link that opens its file at that place. The box is shown, not said: the service
takes it off a reply before the model reads the conversation again (`SOURCES_START`)."""

from __future__ import annotations

import html

from pipeline.service.messages import SOURCES_START

PASSAGE_CHARS = 700  # of a source's text shown under the reply (the link opens the whole file)


def sources_markdown(sources: list[dict] | None) -> str:
    """The box for `sources` (as `Library.shown` gives them), to append to the reply; "" for none."""
    if not sources:
        return ""
    cited = sources[0]["cited"]
    heading = "Sources: " if cited else "The reply cites no source; it was given: "
    names = " · ".join(f"[{s['number']}] {html.escape(s['where'])}" for s in sources)
    blocks = []
    for s in sources:
        text = s["text"] if len(s["text"]) <= PASSAGE_CHARS else s["text"][:PASSAGE_CHARS].rsplit(" ", 1)[0] + " …"
        quoted = "\n".join(f"> {line}" if line.strip() else ">" for line in html.escape(text).splitlines())
        blocks.append(f"**[{s['number']}] [{s['where']}]({s['link']})**\n\n{quoted}")
    return f"{SOURCES_START}<summary>{heading}{names}</summary>\n\n" + "\n\n".join(blocks) + "\n\n</details>"
