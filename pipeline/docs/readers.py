"""A user's file → its text in sections, each with where it is (a PDF's page, a heading, a code file's lines), by
the field's libraries: `pypdfium2` for PDF (its text layer), `python-docx` for Word, BeautifulSoup for HTML;
Markdown, plain text and source code as text. A file that cannot be read raises `Unreadable` with the reason a
user can act on (encrypted, scanned, binary, empty, too large), and the collection lists it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path

MAX_FILE_BYTES = 256 << 20  # a larger file is listed as too large, not read
TEXT_SUFFIXES = {".txt", ".text", ".rst", ".log", ".csv", ".tsv", ".json", ".yaml", ".yml", ".toml", ".ini", ".cfg"}
MARKDOWN_SUFFIXES = {".md", ".markdown"}
HTML_SUFFIXES = {".html", ".htm", ".xhtml"}
CODE_SUFFIXES = {".py", ".js", ".ts", ".tsx", ".jsx", ".java", ".c", ".h", ".cc", ".cpp", ".hpp", ".cs", ".go", ".rs",
                 ".rb", ".php", ".swift", ".kt", ".scala", ".sh", ".bash", ".sql", ".r", ".m", ".lua", ".pl"}
CODE_LINES = 60  # a code file's section: this many lines (its passages split further by tokens)
ATX_HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.+?)[ \t#]*$")


class Unreadable(Exception):
    """A file that cannot be indexed; its message is the reason shown beside it."""


@dataclasses.dataclass(frozen=True)
class Section:
    """A run of a document's text and where it is: `page` (1-based, PDFs) and/or `heading` (its section's title,
    or a code file's "lines a–b"); `start` its first character in the document's text (`Document.text`)."""

    text: str
    start: int
    page: int | None = None
    heading: str | None = None


@dataclasses.dataclass(frozen=True)
class Document:
    sections: list[Section]
    pages: int  # a PDF's pages; 1 for the others

    @property
    def text(self) -> str:
        return "\n\n".join(s.text for s in self.sections)


def supported(path: Path) -> bool:
    suffix = path.suffix.lower()
    return suffix in READERS or suffix in TEXT_SUFFIXES | MARKDOWN_SUFFIXES | HTML_SUFFIXES | CODE_SUFFIXES


def read_document(path: Path) -> Document:
    """`path`'s sections, or `Unreadable` with the reason."""
    try:
        size = path.stat().st_size
    except PermissionError:
        raise Unreadable("cannot be read (permission denied)") from None
    except OSError as e:
        raise Unreadable(f"cannot be read ({e.strerror or e})") from None
    if size == 0:
        raise Unreadable("empty file")
    if size > MAX_FILE_BYTES:
        raise Unreadable(f"too large to index ({size / 2**20:.0f} MB; the limit is {MAX_FILE_BYTES >> 20} MB)")
    suffix = path.suffix.lower()
    reader = READERS.get(suffix) or (_markdown if suffix in MARKDOWN_SUFFIXES else _html if suffix in HTML_SUFFIXES
                                     else _code if suffix in CODE_SUFFIXES else _plain)
    try:
        document = reader(path)
    except Unreadable:
        raise
    except PermissionError:
        raise Unreadable("cannot be read (permission denied)") from None
    except OSError as e:
        raise Unreadable(f"cannot be read ({e.strerror or e})") from None
    if not any(s.text.strip() for s in document.sections):
        raise Unreadable("no text to read")
    return document


def _sections(parts: list[tuple[str, int | None, str | None]]) -> list[Section]:
    """(text, page, heading) runs → sections with their offsets in the joined text (empty runs dropped)."""
    out, start = [], 0
    for text, page, heading in parts:
        text = text.strip()
        if text:
            out.append(Section(text, start, page, heading))
            start += len(text) + 2
    return out


def _decoded(path: Path) -> str:
    """A text file's content: UTF-8 (a BOM dropped), else Latin-1 where it holds no control bytes; a file with NUL
    bytes is binary, whatever its name says."""
    data = path.read_bytes()
    if b"\x00" in data[:65536]:
        raise Unreadable("binary content, not text (its name says text)")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        text = data.decode("latin-1")
        if sum(ch < " " and ch not in "\t\r\n\f" for ch in text[:65536]) > 0.01 * min(len(text), 65536):
            raise Unreadable("binary content, not text (its name says text)") from None
        return text


def _plain(path: Path) -> Document:
    return Document(_sections([(_decoded(path), None, None)]), 1)


def _markdown(path: Path) -> Document:
    """Split at ATX headings (`#`…`######`) outside fenced code; each section titled by its heading path."""
    parts: list[tuple[str, int | None, str | None]] = []
    trail: list[str] = []
    lines: list[str] = []
    fenced = False

    def flush() -> None:
        parts.append(("\n".join(lines), None, " › ".join(trail) or None))
        lines.clear()

    for line in _decoded(path).splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        heading = None if fenced else ATX_HEADING.match(line)
        if heading:
            flush()
            level = len(heading[1])
            trail[level - 1:] = [heading[2].strip()]
            del trail[level:]
        lines.append(line)
    flush()
    return Document(_sections(parts), 1)


def _code(path: Path) -> Document:
    lines = _decoded(path).splitlines()
    parts = [("\n".join(lines[i:i + CODE_LINES]), None, f"lines {i + 1}–{min(i + CODE_LINES, len(lines))}")
             for i in range(0, len(lines), CODE_LINES)]
    return Document(_sections(parts), 1)


def _html(path: Path) -> Document:
    """The page's visible text (scripts, styles and navigation dropped), split at its h1–h6 headings."""
    from bs4 import BeautifulSoup, Comment, Declaration, Doctype, ProcessingInstruction

    soup = BeautifulSoup(_decoded(path), "html.parser")
    for hidden in soup(["script", "style", "noscript", "template", "nav", "head", "svg"]):
        hidden.decompose()
    parts: list[tuple[str, int | None, str | None]] = []
    heading, texts = None, []
    for element in soup.find_all(string=True):
        if isinstance(element, (Comment, Declaration, Doctype, ProcessingInstruction)):
            continue
        parent = element.parent
        header = next((p for p in [parent, *parent.parents] if p.name and re.fullmatch(r"h[1-6]", p.name)), None)
        if header is not None:
            title = " ".join(header.get_text(" ").split())
            if title != heading:
                parts.append((" ".join(texts), None, heading))
                heading, texts = title, []
            continue
        if element.strip():
            texts.append(" ".join(element.split()))
    parts.append((" ".join(texts), None, heading))
    return Document(_sections(parts), 1)


def _pdf(path: Path) -> Document:
    """Each page's text layer, numbered from 1; a PDF whose pages hold no text is scanned (no OCR here)."""
    import pypdfium2 as pdfium

    try:
        pdf = pdfium.PdfDocument(str(path))
    except pdfium.PdfiumError as e:
        if "password" in str(e).lower():
            raise Unreadable("encrypted: it needs a password, which the index does not have") from None
        raise Unreadable(f"not a readable PDF ({e})") from None
    try:
        pages = len(pdf)
        parts = []
        for number in range(pages):
            page = pdf[number]
            textpage = page.get_textpage()
            parts.append((textpage.get_text_range().replace("\r\n", "\n"), number + 1, None))
            textpage.close()
            page.close()
    finally:
        pdf.close()
    sections = _sections(parts)
    if not sections:
        raise Unreadable("no text to read (scanned pages; OCR is not available)")
    return Document(sections, pages)


def _docx(path: Path) -> Document:
    """Paragraphs and tables in order, split at the document's Heading styles."""
    import zipfile

    import docx
    from docx.opc.exceptions import PackageNotFoundError

    try:
        document = docx.Document(str(path))
    except (zipfile.BadZipFile, PackageNotFoundError, KeyError, ValueError) as e:
        raise Unreadable(f"not a readable Word document ({type(e).__name__}: {e})") from None
    parts: list[tuple[str, int | None, str | None]] = []
    heading, texts = None, []
    for block in document.iter_inner_content():
        if isinstance(block, docx.table.Table):
            texts.extend(" | ".join(cell.text.strip() for cell in row.cells) for row in block.rows)
            continue
        style = (block.style.name if block.style is not None else "") or ""
        if style.startswith("Heading") or style == "Title":
            parts.append(("\n".join(texts), None, heading))
            heading, texts = block.text.strip() or heading, []
        elif block.text.strip():
            texts.append(block.text.strip())
    parts.append(("\n".join(texts), None, heading))
    return Document(_sections(parts), 1)


READERS: dict[str, Callable[[Path], Document]] = {".pdf": _pdf, ".docx": _docx}
