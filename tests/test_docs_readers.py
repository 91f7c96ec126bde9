"""The documents readers (`pipeline/docs/readers.py`) on files other programs wrote: PDFs by fpdf2 (pages, an
encrypted one, one of images only), Word files by python-docx, HTML by docutils, Markdown as a package's README
ships (httpx's, from its installed metadata), Python's own source; each with its pages or headings right. Then a
folder of bad files beside good ones: each bad one listed with its reason, the rest indexed."""

import importlib.metadata
import json
import os
from pathlib import Path

import pytest

from pipeline.docs.chunking import passages
from pipeline.docs.readers import CODE_LINES, Unreadable, read_document

fpdf = pytest.importorskip("fpdf")
docutils_core = pytest.importorskip("docutils.core")

PAGES = ["The lighthouse keeper climbs one hundred and twelve steps every evening.",
         "Page two is about the fog horn, which sounds every thirty seconds.",
         "On the third page the keeper logs ships passing the reef."]


def write_pdf(path: Path, pages: list[str], password: str | None = None, image: bool = False) -> Path:
    pdf = fpdf.FPDF()
    pdf.set_font("helvetica", size=12)
    for text in pages:
        pdf.add_page()
        if image:  # a scan: the page is a picture, no text layer
            from PIL import Image

            pdf.image(Image.new("RGB", (200, 100), (200, 200, 200)), x=10, y=10, w=100)
        else:
            pdf.multi_cell(0, 8, text)
    if password:
        pdf.set_encryption(owner_password="owner", user_password=password)
    pdf.output(str(path))
    return path


def test_a_pdf_is_read_page_by_page(tmp_path):
    document = read_document(write_pdf(tmp_path / "keeper.pdf", PAGES))
    assert document.pages == 3
    assert [(s.page, " ".join(s.text.split())) for s in document.sections] == [(i + 1, t) for i, t in enumerate(PAGES)]
    assert all(document.text[s.start:s.start + len(s.text)] == s.text for s in document.sections)


def test_a_word_document_is_split_at_its_headings_tables_included(tmp_path):
    import docx

    doc = docx.Document()
    doc.add_heading("Lighthouse manual", 0)
    doc.add_paragraph("Keep the lamp clean.")
    doc.add_heading("Fog horn", 1)
    doc.add_paragraph("Sound it every thirty seconds in fog.")
    table = doc.add_table(rows=2, cols=2)
    for r, row in enumerate([("signal", "meaning"), ("three blasts", "danger")]):
        for c, text in enumerate(row):
            table.cell(r, c).text = text
    doc.add_heading("Log book", 1)
    doc.add_paragraph("Write down every ship.")
    doc.save(tmp_path / "manual.docx")
    sections = read_document(tmp_path / "manual.docx").sections
    assert [(s.heading, s.text) for s in sections] == [
        ("Lighthouse manual", "Keep the lamp clean."),
        ("Fog horn", "Sound it every thirty seconds in fog.\nsignal | meaning\nthree blasts | danger"),
        ("Log book", "Write down every ship.")]


def test_an_html_page_is_split_at_its_headings_without_its_scripts(tmp_path):
    rst = ("Lighthouse\n==========\n\nThe lamp turns.\n\nFog\n---\n\nThe horn sounds every *thirty* seconds.\n\n"
           ".. raw:: html\n\n   <script>var hidden = 'do not index';</script>\n\nShips\n-----\n\nLog them.\n")
    html = docutils_core.publish_string(rst, writer="html5").decode()
    (tmp_path / "page.html").write_text(html)
    sections = read_document(tmp_path / "page.html").sections
    assert [(s.heading, s.text) for s in sections] == [("Lighthouse", "The lamp turns."),
                                                      ("Fog", "The horn sounds every thirty seconds."),
                                                      ("Ships", "Log them.")]


def test_a_packages_markdown_readme_keeps_its_heading_path(tmp_path):
    readme = importlib.metadata.metadata("httpx").get_payload()
    (tmp_path / "README.md").write_text(readme)
    sections = read_document(tmp_path / "README.md").sections
    headings = [s.heading for s in sections if s.heading]
    assert len(headings) >= 5 and any(" › " in h for h in headings) is (readme.count("\n### ") > 0)
    for s in sections[1:]:
        assert s.text.lstrip().startswith("#") and s.heading.split(" › ")[-1] in s.text.splitlines()[0]


def test_source_code_is_read_in_numbered_runs_of_lines(tmp_path):
    source = Path(json.__file__)
    sections = read_document(source).sections
    lines = source.read_text().splitlines()
    assert sections[0].heading == f"lines 1–{CODE_LINES}" and sections[0].text == "\n".join(lines[:CODE_LINES]).strip()
    assert sections[-1].heading.endswith(f"–{len(lines)}")


def test_passages_keep_their_span_and_fit_the_token_limit(tmp_path):
    document = read_document(write_pdf(tmp_path / "long.pdf", [" ".join(PAGES * 30)] * 2))
    words = lambda text: len(text.split())  # noqa: E731 - a stand-in tokenizer: a word a token
    found = passages(document, words, 50, 15)  # a sentence (11-12 words) is carried over
    assert len(found) > 4 and all(words(p.text) <= 50 for p in found)
    assert all(document.text[p.start:p.end] == p.text for p in found)
    assert {p.page for p in found} == set(range(1, document.pages + 1)) and document.pages > 2
    first_page = [p for p in found if p.page == 1]
    assert all(set(a.text.split()[-5:]) & set(b.text.split()[:15]) for a, b in zip(first_page, first_page[1:]))


@pytest.mark.parametrize("name, make, reason", [
    ("secret.pdf", lambda p: write_pdf(p, PAGES, password="user"), "encrypted: it needs a password"),
    ("broken.pdf", lambda p: p.write_bytes(write_pdf(p, PAGES).read_bytes()[:300]), "not a readable PDF"),
    ("scan.pdf", lambda p: write_pdf(p, PAGES, image=True), "no text to read (scanned pages; OCR is not available)"),
    ("empty.txt", lambda p: p.write_bytes(b""), "empty file"),
    ("binary.txt", lambda p: p.write_bytes(b"\x7fELF\x02\x01\x01" + bytes(1000)), "binary content, not text"),
    ("garbage.txt", lambda p: p.write_bytes(bytes(range(1, 256)) * 10), "binary content, not text"),
    ("huge.txt", lambda p: os.truncate(p.write_bytes(b"x") and p, 500 << 20), "too large to index (500 MB"),
    ("fake.docx", lambda p: p.write_text("not a zip"), "not a readable Word document"),
])
def test_a_bad_file_says_why(tmp_path, name, make, reason):
    make(tmp_path / name)
    with pytest.raises(Unreadable) as e:
        read_document(tmp_path / name)
    assert str(e.value).startswith(reason), str(e.value)


def test_a_folder_of_bad_files_lists_each_with_its_reason_and_indexes_the_rest(tmp_path):
    from test_docs_index import WordEmbedder

    from pipeline.docs.index import Index
    from pipeline.docs.indexer import Indexer

    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    write_pdf(folder / "keeper.pdf", PAGES)
    (folder / "sub" / "notes.md").write_text("# Notes\n\nThe reef is north of the light.\n")
    write_pdf(folder / "secret.pdf", PAGES, password="user")
    (folder / "broken.pdf").write_bytes((folder / "keeper.pdf").read_bytes()[:300])
    (folder / "empty.txt").write_bytes(b"")
    (folder / "binary.txt").write_bytes(bytes(range(256)) * 10)
    (folder / "huge.txt").write_bytes(b"x")
    os.truncate(folder / "huge.txt", 500 << 20)  # sparse: 500 MB on paper
    (folder / "photo.png").write_bytes(b"\x89PNG")
    (folder / "sub" / "loop").symlink_to(folder)
    (folder / "gone.txt").symlink_to(tmp_path / "nowhere.txt")
    index = Index(tmp_path / "index.db", "words", WordEmbedder.dim)
    index.add_collection("docs", str(folder))
    summary = Indexer(index, WordEmbedder()).refresh("docs", folder)
    rows = {f.path: (f.passages, f.reason) for f in index.files(index.collection("docs"))}
    assert rows["keeper.pdf"][0] == 3 and rows["keeper.pdf"][1] is None
    assert rows["sub/notes.md"][0] == 1 and rows["sub/notes.md"][1] is None
    reasons = {path: reason for path, (_, reason) in rows.items() if reason}
    assert str(reasons.pop("broken.pdf", None)).startswith("not a readable PDF (")
    assert reasons == {
        "secret.pdf": "encrypted: it needs a password, which the index does not have",
        "empty.txt": "empty file",
        "binary.txt": "binary content, not text (its name says text)",
        "huge.txt": "too large to index (500 MB; the limit is 256 MB)",
        "photo.png": "not a document type read here (.png)",
        "sub/loop": "a symlink loop (this folder is already in the collection)",
        "gone.txt": "a broken link (what it points to is gone)",
    }, reasons
    assert (summary.read, summary.unreadable) == (2, 8), summary
