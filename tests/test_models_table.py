"""The Models tab's table in a user's words: parameter counts as people write them, sizes only for what
is on disk, and the memory each model takes here against the room there is: a GPU's budget, or on the CPU the
memory free now (a model in use there holds its memory already)."""

from pathlib import Path

from app.models_tab import count_text, model_table
from pipeline.models import ModelEntry
from pipeline.service.tools import Tool


def entry(model_id: str, params: int | None, path: Path | None, memory_bytes: int | None) -> ModelEntry:
    return ModelEntry(model_id, "LLM", "qwen2", params, 3 << 20 if path else 0, "float32", memory_bytes, "built-in demo",
                      path, (Tool.CHAT,))


def test_parameter_counts_read_as_people_write_them():
    assert [count_text(n) for n in (None, 0, 213_000, 135_000_000, 636_000_000, 7_615_616_512, 72_000_000_000)] == \
        ["", "", "0.21 M", "135 M", "636 M", "7.6 B", "72 B"]


def test_memory_against_the_gpu_budget_or_the_cpu_free_memory_and_no_size_for_what_is_not_on_disk(tmp_path):
    entries = [entry("demo/qwen2-tiny", 213_000, None, None), entry("Qwen/Qwen2.5-7B", 7_615_616_512, tmp_path, 16 << 30),
               entry("smollm2", 135_000_000, tmp_path, 300 << 20)]
    using = {Tool.CHAT: "smollm2"}
    headers, rows = model_table(entries, None, using)  # no limit: no "Fits"
    assert "Fits" not in headers and all(len(row) == len(headers) for row in rows)
    cells = [dict(zip(headers, row)) for row in rows]
    assert cells[0]["Parameters"] == "0.21 M" and cells[0]["On disk"] == "" and cells[2]["In use by"] == "chat"
    assert cells[1]["Parameters"] == "7.6 B" and cells[1]["On disk"] == "3 MiB" and cells[1]["Memory"] == "16.00 GiB"
    headers, rows = model_table(entries, (24 << 30, "budget"), using)  # a GPU with a 24 GiB budget
    cells = [dict(zip(headers, row)) for row in rows]
    assert cells[1]["Memory"] == "16.00 GiB" and cells[1]["Fits"] == "yes" and cells[0]["Fits"] == ""
    headers, rows = model_table(entries, (8 << 30, "budget"), using)
    assert [dict(zip(headers, row))["Fits"] for row in rows[1:]] == ["no (8.00 GiB budget)", "yes"]
    headers, rows = model_table(entries, (200 << 20, "free"), using)  # the CPU with 200 MiB free
    assert [dict(zip(headers, row))["Fits"] for row in rows[1:]] == ["no (200 MiB free)", "in use"]


def test_engine_terms_only_with_verbose_and_a_gguf_files_blocks_beside_its_kind(tmp_path):
    gguf = ModelEntry("owner/repo:Q4_K_M", "LLM", "qwen2", 7_615_616_512, 4 << 30, "Q4_K blocks as stored", 5 << 30,
                      "Hugging Face cache", tmp_path, (Tool.CHAT,), quant="Q4_K_M")
    headers, rows = model_table([gguf], (24 << 30, "budget"), {})
    assert headers == ["Model", "Kind", "Parameters", "On disk", "Memory", "Fits", "Where", "In use by"]
    assert dict(zip(headers, rows[0]))["Kind"] == "LLM · Q4_K_M"
    headers, rows = model_table([gguf], (24 << 30, "budget"), {}, verbose=True)
    assert dict(zip(headers, rows[0]))["Family"] == "qwen2" and dict(zip(headers, rows[0]))["Runs as"] == \
        "Q4_K blocks as stored"
