"""The Models tab's table in a user's words: parameter counts as people write them, sizes only for what
is on disk, and the GPU columns only where there is a GPU budget to fit."""

from pathlib import Path

from app.models_tab import GPU_COLUMNS, count_text, model_table
from pipeline.models import ModelEntry
from pipeline.service.tools import Tool


def entry(model_id: str, params: int | None, path: Path | None, gpu_bytes: int | None) -> ModelEntry:
    return ModelEntry(model_id, "LLM", "qwen2", params, 3 << 20 if path else 0, "float32", gpu_bytes, "built-in demo",
                      path, (Tool.CHAT,))


def test_parameter_counts_read_as_people_write_them():
    assert [count_text(n) for n in (None, 0, 213_000, 135_000_000, 636_000_000, 7_615_616_512, 72_000_000_000)] == \
        ["", "", "0.21 M", "135 M", "636 M", "7.6 B", "72 B"]


def test_gpu_columns_only_with_a_budget_and_no_size_for_what_is_not_on_disk(tmp_path):
    entries = [entry("demo/qwen2-tiny", 213_000, None, None), entry("Qwen/Qwen2.5-7B", 7_615_616_512, tmp_path, 16 << 30)]
    using = {Tool.CHAT: "demo/qwen2-tiny"}
    headers, rows = model_table(entries, None, using)  # the CPU: no budget
    assert not set(GPU_COLUMNS) & set(headers) and all(len(row) == len(headers) for row in rows)
    cells = [dict(zip(headers, row)) for row in rows]
    assert cells[0]["Parameters"] == "0.21 M" and cells[0]["On disk"] == "" and cells[0]["In use by"] == "chat"
    assert cells[1]["Parameters"] == "7.6 B" and cells[1]["On disk"] == "3 MiB"
    headers, rows = model_table(entries, 24 << 30, using)  # a GPU with a 24 GiB budget
    cells = [dict(zip(headers, row)) for row in rows]
    assert cells[1]["GPU memory"] == "16.00 GiB" and cells[1]["Fits"] == "yes"
    headers, rows = model_table(entries, 8 << 30, using)
    assert dict(zip(headers, rows[1]))["Fits"] == "no (8.00 GiB budget)"
