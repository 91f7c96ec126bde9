"""GGUF files in the Models tab's catalog and `/v1/models`: found in the Hugging Face cache (one entry per
model file, split parts as one, id `owner/repo:TAG`), in `--models-dir` (loose files and folders of them,
id: the path) and the SmolLM2 that comes with the app; each with its quantization (from the file's
metadata) and size on disk; downloaded by tag from a local hub (tests/hub_server.py) with Cancel and
resume; deleted like other downloads; switched to through `locate`.

The catalog runs in a child process: huggingface_hub reads HF_ENDPOINT and HF_HUB_CACHE when it is imported."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType

from hub_server import serving

ROOT = Path(__file__).resolve().parents[1]
FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q8_0": 7}  # llama.cpp's `general.file_type`
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _byte_tokens() -> list[str]:
    """GPT-2's byte-level alphabet: the 256 characters its BPE vocabularies start from."""
    shown = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = dict(zip(shown, shown)), 256
    for b in range(256):
        if b not in chars:
            chars[b], extra = extra, extra + 1
    return [chr(chars[b]) for b in range(256)]


def write_gguf(path: Path, kind: str = "Q8_0", hidden: int = 64, ffn: int = 128, parts: int = 1) -> list[Path]:
    """A tiny random LLaMA in a GGUF file with a gpt2-style vocabulary (`gguf_tokenizer.py`'s keys) and a
    ChatML template, its matrices stored as `kind`; `parts` > 1: split, the first part holding the metadata,
    the embedding and the final norm, the others the layer. Returns the files."""
    rng = np.random.default_rng(len(path.name))
    tokens = [*_byte_tokens(), "Ġt", "he", "<|im_start|>", "<|im_end|>"]
    shapes = {"token_embd.weight": (len(tokens), hidden), "output_norm.weight": (hidden,),
              "blk.0.attn_norm.weight": (hidden,), "blk.0.ffn_norm.weight": (hidden,),
              "blk.0.attn_q.weight": (hidden, hidden), "blk.0.attn_k.weight": (hidden // 2, hidden),
              "blk.0.attn_v.weight": (hidden // 2, hidden), "blk.0.attn_output.weight": (hidden, hidden),
              "blk.0.ffn_gate.weight": (ffn, hidden), "blk.0.ffn_up.weight": (ffn, hidden),
              "blk.0.ffn_down.weight": (hidden, ffn)}
    names = list(shapes)
    files = [path] if parts == 1 else \
        [path.with_name(f"{path.name.removesuffix('.gguf')}-{n:05d}-of-{parts:05d}.gguf") for n in range(1, parts + 1)]
    for n, file in enumerate(files):
        writer = gguf.GGUFWriter(file, "llama")
        if n == 0:
            writer.add_block_count(1)
            writer.add_context_length(512)
            writer.add_embedding_length(hidden)
            writer.add_feed_forward_length(ffn)
            writer.add_head_count(4)
            writer.add_head_count_kv(2)
            writer.add_layer_norm_rms_eps(1e-5)
            writer.add_rope_freq_base(10000.0)
            writer.add_file_type(FILE_TYPES[kind])
            writer.add_tokenizer_model("gpt2")
            writer.add_tokenizer_pre("default")
            writer.add_token_list(tokens)
            writer.add_token_types([1] * (len(tokens) - 2) + [3, 3])
            writer.add_token_merges(["Ġ t", "h e"])
            writer.add_bos_token_id(len(tokens) - 2)
            writer.add_eos_token_id(len(tokens) - 1)
            writer.add_chat_template(CHATML)
        for name in names if parts == 1 else names[:2] if n == 0 else names[2:] if n == 1 else []:
            shape = shapes[name]
            if len(shape) == 1:
                writer.add_tensor(name, np.ones(shape, np.float32))
                continue
            weights = (rng.standard_normal(shape) * 0.05).astype(np.float32)
            if kind in ("F32", "F16"):
                writer.add_tensor(name, weights.astype(np.float16 if kind == "F16" else np.float32))
            else:
                quant = GGMLQuantizationType[kind]
                writer.add_tensor(name, gguf.quants.quantize(weights, quant), raw_dtype=quant)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return files


def fake_hub_cache(cache: Path, repo: str, files: dict[str, Path]) -> Path:
    """`files` (name in the repo → its content) as huggingface_hub keeps a download: blobs by hash, a
    snapshot of links to them, refs/main. Returns the snapshot folder."""
    root = cache / f"models--{repo.replace('/', '--')}"
    commit = hashlib.sha1(repo.encode()).hexdigest()
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    (root / "blobs").mkdir()
    for name, source in files.items():
        data = source.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = root / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return root / "snapshots" / commit


# The catalog as the app makes it, over stand-ins for the plan, engines and tool host; runs each action
# of argv[1] (JSON) and prints one JSON line of results.
CHILD = """
import dataclasses, json, os, sys, threading, types
from pathlib import Path
from pipeline.errors import UserError
from pipeline.service.tools import Tool
from studio import hub_progress
from studio.backends import BackendChoice
from studio.compose import configure_process
from studio.config import StudioConfig
from studio.model_catalog import ModelCatalog
from studio.model_finder import ModelFinder
from studio.plan import Plan

job = json.loads(sys.argv[1])
configure_process()  # huggingface_hub's reads of 1 MiB, as the app starts with
hub_progress.EVERY_S = 0  # every read reported
config = StudioConfig(models_dir=job.get("models_dir") and Path(job["models_dir"]), context=256,
                      minigpt4_llm=Path("unused"))
plan = Plan({"chat": BackendChoice("torch", "test")}, "cpu", "float32", job["model"], "demo/sam-tiny", ())
finder = ModelFinder(config, "float32", "cpu", None, Path(job["engines"]))
catalog = ModelCatalog(config, plan, types.SimpleNamespace(budget=None, loaded=lambda tool: None), finder, None,
                       lambda line: None)


def entries():
    return [{"id": e.id, "kind": e.kind, "family": e.family, "params": e.params, "quant": e.quant,
             "disk": e.disk_bytes, "source": e.source, "tools": list(e.tools),
             "path": str(e.path) if e.path else None, "files": [str(f) for f in e.files]} for e in catalog.refresh()]


def download(model_id, kept=None):  # kept: cancel once that file is in the cache (progress sums all files)
    said, cancel = [], threading.Event()
    def say(line):
        said.append(line)
        if kept and list(Path(os.environ["HF_HUB_CACHE"]).glob(f"models--*/snapshots/*/{kept}")):
            cancel.set()
    path = catalog.download(model_id, say, cancel)
    return {"said": said, "path": str(path)}


def v1_models():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from app.openai_api import build_router
    from pipeline.service.studio import StudioService

    app = FastAPI()
    app.include_router(build_router(StudioService(types.SimpleNamespace(loaded=lambda tool: None), catalog=catalog), None, False))
    return [m["id"] for m in TestClient(app).get("/v1/models").json()["data"]]


def locate_all():
    from pipeline.models import locate
    return {e.id: str(locate(e.id).path) == str(e.path) for e in catalog.models() if e.files and e.kind == "LLM"}


ACTIONS = {"find": entries, "download": download, "delete": catalog.delete,
           "delete_plan": lambda model_id: catalog.delete_plan(model_id)[1], "servable": catalog.servable,
           "v1_models": v1_models, "locate_all": locate_all,
           "run": lambda model_id: setattr(catalog, "plan", dataclasses.replace(plan, model_id=model_id))}
out = []
for name, *params in job["actions"]:
    try:
        out.append({"ok": ACTIONS[name](*params)})
    except UserError as e:
        out.append({"error": str(e)})
print(json.dumps(out))
"""


def run_catalog(tmp_path: Path, cache: Path, actions: list, hub_url: str = "http://127.0.0.1:9",
                model: str = "demo/qwen-v1-tiny", models_dir: Path | None = None) -> list[dict]:
    """The results of `actions` (see CHILD) with the Hugging Face cache in `tmp_path`, ours at `cache`
    (shared by the tests: the built-in SmolLM2's folder is made once, its header read taking seconds)."""
    env = {**os.environ, "HF_ENDPOINT": hub_url, "HF_HUB_CACHE": str(tmp_path / "hf-cache"),
           "STUDIO_CACHE": str(cache), "PYTHONPATH": str(ROOT), "HF_HUB_DISABLE_TELEMETRY": "1"}
    job = {"actions": actions, "model": model, "models_dir": str(models_dir) if models_dir else None,
           "engines": str(tmp_path / "engines")}
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(job)], env=env, capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _sizes(*files: Path) -> int:
    return sum(f.stat().st_size for f in files)


@pytest.fixture
def models(tmp_path):
    """A hub repo of three GGUF models (one split) and a README in a fake HF cache, a repo whose two files
    share a quantization, and a models folder: a loose file, a split one, LM Studio's publisher/model/
    file layout, a damaged file."""
    src = tmp_path / "src"
    src.mkdir()
    q8, q4 = write_gguf(src / "tiny-Q8_0.gguf")[0], write_gguf(src / "tiny-Q4_0.gguf", "Q4_0")[0]
    f16 = write_gguf(src / "tiny-F16.gguf", "F16", parts=2)
    (src / "README.md").write_text("# tiny")
    hub = tmp_path / "hf-cache"
    fake_hub_cache(hub, "studio-test/tiny-GGUF", {"tiny-Q8_0.gguf": q8, "tiny-Q4_0.gguf": q4, "README.md":
                                                  src / "README.md", **{f.name: f for f in f16}})
    fake_hub_cache(hub, "studio-test/two-GGUF", {"one-Q8_0.gguf": q8, "two-Q8_0.gguf": q4})
    folder = tmp_path / "models"
    (folder / "lmstudio-community" / "tiny").mkdir(parents=True)
    write_gguf(folder / "loose.Q8_0.gguf")
    write_gguf(folder / "split.F16.gguf", "F16", parts=2)
    write_gguf(folder / "lmstudio-community" / "tiny" / "tiny-Q4_0.gguf", "Q4_0")
    (folder / "broken.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 64)
    return {"q8": q8, "q4": q4, "f16": f16, "folder": folder, "hub": hub}


def test_gguf_files_are_listed_with_their_quantization_size_and_family(tmp_path, studio_cache, models):
    from pipeline.models import EMBEDDED, embedded_gguf

    folder = models["folder"]
    found, servable, v1, located = run_catalog(tmp_path, studio_cache, [["find"], ["servable"], ["v1_models"],
                                                                        ["locate_all"]], models_dir=folder)
    by_id = {e["id"]: e for e in found["ok"]}
    tiny = {tag: by_id.get(f"studio-test/tiny-GGUF:{tag}") for tag in ("Q8_0", "Q4_0", "F16")}
    assert all(tiny.values()), sorted(by_id)
    assert "studio-test/tiny-GGUF" not in by_id  # the repo itself is no model: it has no config.json
    assert {tag: e["quant"] for tag, e in tiny.items()} == {"Q8_0": "Q8_0", "Q4_0": "Q4_0", "F16": "F16"}
    assert [tiny[tag]["disk"] for tag in ("Q8_0", "Q4_0", "F16")] == \
        [_sizes(models["q8"]), _sizes(models["q4"]), _sizes(*models["f16"])]  # a split model's parts together
    assert len(tiny["F16"]["files"]) == 2
    params = 260 * 64 + 3 * 64 + 2 * 64 * 64 + 2 * 32 * 64 + 3 * 128 * 64  # tied embedding, norms, q o k v, MLP
    for e in tiny.values():
        assert (e["kind"], e["family"], e["params"], e["source"]) == ("LLM", "llama", params, "Hugging Face cache"), e
        assert "chat" in e["tools"]
    assert {i for i in by_id if i.startswith("studio-test/two-GGUF")} == \
        {"studio-test/two-GGUF:one-Q8_0", "studio-test/two-GGUF:two-Q8_0"}  # Q8_0 alone picks both: the names

    loose, split = by_id[str(folder / "loose.Q8_0.gguf")], by_id[str(folder / "split.F16-00001-of-00002.gguf")]
    nested = by_id[str(folder / "lmstudio-community" / "tiny" / "tiny-Q4_0.gguf")]
    assert (loose["quant"], loose["disk"], loose["source"]) == ("Q8_0", _sizes(folder / "loose.Q8_0.gguf"),
                                                                "models folder")
    assert (split["quant"], split["disk"]) == ("F16", _sizes(*folder.glob("split.F16-*.gguf")))
    assert str(folder / "split.F16-00002-of-00002.gguf") not in by_id
    assert (nested["quant"], nested["family"]) == ("Q4_0", "llama")
    broken = by_id[str(folder / "broken.gguf")]
    assert broken["kind"] == "other" and broken["family"].startswith("not supported") and not broken["tools"]

    if embedded_gguf() is not None:
        smollm = by_id[EMBEDDED]
        assert (smollm["quant"], smollm["source"], smollm["family"]) == ("Q4_1", "built in", "llama")
        assert 100e6 < smollm["params"] < 200e6 and smollm["disk"] == embedded_gguf().stat().st_size

    chat = {i for i, e in by_id.items() if e["quant"] and "chat" in e["tools"]}
    assert len(chat) == 9 - (embedded_gguf() is None), sorted(chat)
    assert chat <= set(servable["ok"]) and chat <= set(v1["ok"])  # /v1/models lists them
    assert located["ok"] and all(located["ok"].values()), located  # a switch loads the folder listed


def test_a_tag_downloads_only_its_files_cancel_stops_it_and_the_next_resumes(tmp_path, studio_cache):
    src = tmp_path / "repo"
    src.mkdir()
    write_gguf(src / "big-Q8_0.gguf")
    big = write_gguf(src / "big-F16.gguf", "F16", hidden=1024, ffn=6144, parts=2)  # part 2: 44 MiB
    (src / "README.md").write_text("# big")
    (src / "config.json").write_text("{}")
    with serving({"studio-test/big-GGUF": src}, delay_s=0.002) as hub:
        cancelled, bad, none_there = run_catalog(tmp_path, studio_cache, [
            ["download", "studio-test/big-GGUF:f16", big[0].name], ["download", "studio-test/big-GGUF:Q5_K_M"],
            ["download", "studio-test/nothing-GGUF:Q4_K_M"]], hub.url)
        assert "error" in cancelled, cancelled["ok"]["said"]
        assert cancelled["error"].startswith("the download of studio-test/big-GGUF:f16 was cancelled"), cancelled
        assert bad["error"] == ("studio-test/big-GGUF has no GGUF file tagged Q5_K_M: its GGUF files are "
                                "big-F16-00001-of-00002.gguf, big-F16-00002-of-00002.gguf, big-Q8_0.gguf"), bad
        assert none_there["error"].startswith("there is no model studio-test/nothing-GGUF:Q4_K_M on the hub")
        blobs = tmp_path / "hf-cache" / "models--studio-test--big-GGUF" / "blobs"
        assert not [b for b in blobs.iterdir() if b.stat().st_size == big[1].stat().st_size]

        finished, found = run_catalog(tmp_path, studio_cache, [["download", "studio-test/big-GGUF:f16"],
                                                               ["find"]], hub.url)
        assert "error" not in finished, finished
        lines = finished["ok"]["said"]
        assert lines and all(line.startswith("downloaded ") for line in lines), lines
        fetched = [name for name, _ in hub.ranges]
        assert set(fetched) == {big[0].name, big[1].name}, fetched  # not the Q8_0 file, the README or config.json
        assert fetched.count(big[0].name) == 1  # kept from the cancelled download
    snapshot = Path(finished["ok"]["path"]).parent
    assert Path(finished["ok"]["path"]).name == big[0].name
    assert (snapshot / big[1].name).read_bytes() == big[1].read_bytes()
    entry = next(e for e in found["ok"] if e["id"] == "studio-test/big-GGUF:F16")
    assert (entry["quant"], entry["disk"], entry["family"]) == ("F16", _sizes(*big), "llama")


def test_deleting_a_gguf_model_removes_its_files_only(tmp_path, studio_cache, models):
    from pipeline.models import EMBEDDED

    repo = models["hub"] / "models--studio-test--tiny-GGUF"
    folder = models["folder"]
    split = str(folder / "split.F16-00001-of-00002.gguf")
    before, builtin, running, asked, q8, found, parts, f16 = run_catalog(tmp_path, studio_cache, [
        ["find"], ["delete_plan", EMBEDDED], ["delete_plan", "studio-test/tiny-GGUF:Q4_0"],
        ["delete_plan", "studio-test/tiny-GGUF:Q8_0"], ["delete", "studio-test/tiny-GGUF:Q8_0"], ["find"],
        ["delete", split], ["delete", "studio-test/tiny-GGUF:F16"]],
        model="studio-test/tiny-GGUF:q4_0", models_dir=folder)  # the running one, named in another case
    assert builtin["error"] == f"{EMBEDDED} is built in: it is not a download this app manages", builtin
    assert running["error"].startswith("studio-test/tiny-GGUF:Q4_0 is the chat model now"), running
    assert asked["ok"].startswith("Delete studio-test/tiny-GGUF:Q8_0 (") and "Hugging Face cache" in asked["ok"]
    assert q8["ok"] == "Deleted studio-test/tiny-GGUF:Q8_0."
    ids = {e["id"] for e in found["ok"]}
    assert "studio-test/tiny-GGUF:Q8_0" not in ids and {"studio-test/tiny-GGUF:Q4_0", "studio-test/tiny-GGUF:F16",
                                                         "studio-test/two-GGUF:one-Q8_0"} <= ids
    assert parts["ok"] == f"Deleted {split}." and not list(folder.glob("split.F16-*"))
    assert (folder / "loose.Q8_0.gguf").is_file()
    assert f16["ok"] == "Deleted studio-test/tiny-GGUF:F16."
    snapshot = next((repo / "snapshots").iterdir())
    assert sorted(p.name for p in snapshot.iterdir()) == ["README.md", "tiny-Q4_0.gguf"]
    assert len(list((repo / "blobs").iterdir())) == 2  # the other blobs went with their links

    whole, = run_catalog(tmp_path, studio_cache, [["delete", "studio-test/tiny-GGUF:Q4_0"]], models_dir=folder)
    assert whole["ok"] == "Deleted studio-test/tiny-GGUF:Q4_0."  # its last model: the whole repository goes
    assert not (repo / "snapshots").exists() or not list((repo / "snapshots").iterdir())
    assert (models["hub"] / "models--studio-test--two-GGUF" / "blobs").is_dir()  # same bytes, another repo
    assert list((models["hub"] / "models--studio-test--two-GGUF" / "blobs").iterdir())
    gone = [e["path"] for e in before["ok"] if e["id"].startswith("studio-test/tiny-GGUF:") or e["id"] == split]
    assert len(gone) == 4 and not [p for p in gone if Path(p).exists()]  # their model folders in our cache too
    assert all(Path(e["path"]).is_dir() for e in before["ok"] if e["id"].startswith("studio-test/two-GGUF:"))


# The app's own composition (options, plan, service with its catalog), then for each model id after
# argv[1] (the models folder): Chat switched to it and a short reply from it.
SWITCH = """
import json, sys
from studio.compose import build
from studio.config import parse_config
from studio.plan import make_plan

config = parse_config(["--model", "demo/qwen-v1-tiny", "--models-dir", sys.argv[1], "--context", "256"])
service = build(config, make_plan(config), out=None)
out = []
for model_id in sys.argv[2:]:
    lines = list(service.switch("chat", model_id))
    turn = service.chat_turn([{"role": "user", "content": "hi"}], {"max_new_tokens": 4, "seed": 1})
    updates = list(service.reply("test", turn))
    out.append({"lines": lines, "current": service.catalog.current("chat"), "models": service.chat_models(),
                "new_tokens": updates[-1].stats.new_tokens})
service.close()  # as the app ends: no engine thread left running while the interpreter exits
print(json.dumps(out))
"""


@pytest.mark.parametrize("where", ["models folder", "Hugging Face cache"])
def test_chat_switches_to_listed_gguf_models_and_they_answer(tmp_path, studio_cache, models, where):
    folder = models["folder"]
    ids = [str(folder / "loose.Q8_0.gguf"), str(folder / "split.F16-00001-of-00002.gguf")] if where == "models folder" \
        else ["studio-test/tiny-GGUF:Q8_0", "studio-test/tiny-GGUF:F16"]  # a file, a split one
    env = {**os.environ, "HF_HUB_CACHE": str(models["hub"]), "HF_HUB_OFFLINE": "1", "STUDIO_CACHE": str(studio_cache),
           "STUDIO_DATA": str(tmp_path / "data"), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", SWITCH, str(folder), *ids], env=env, capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    for model_id, out in zip(ids, json.loads(done.stdout.strip().splitlines()[-1]), strict=True):
        assert out["lines"][-1] == f"chat now runs {model_id}." and out["current"] == model_id, out
        assert out["models"][0] == model_id and out["new_tokens"] == 4, out


def test_the_command_line_downloads_a_hub_gguf_by_its_tag_and_chats_with_it(tmp_path, studio_cache):
    """`--model owner/repo:TAG` (the terminal chat here): only the tagged file is fetched, then it answers;
    a tag the repository lacks is one line naming the files it has."""
    src = tmp_path / "repo"
    src.mkdir()
    chosen = write_gguf(src / "tiny-Q8_0.gguf")
    write_gguf(src / "tiny-F16.gguf", "F16")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hf-cache"), "STUDIO_CACHE": str(studio_cache),
           "HF_HUB_DISABLE_TELEMETRY": "1"}
    with serving({"studio-test/tiny-GGUF": src}) as hub:
        env["HF_ENDPOINT"] = hub.url
        done = subprocess.run([sys.executable, "launch.py", "chat", "--model", "studio-test/tiny-GGUF:q8_0"],
                              input="Hello\n/exit\n", env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and "tok/s" in done.stderr, done.stderr[-2000:]
        assert {name for name, _ in hub.ranges} == {chosen[0].name}
        bad = subprocess.run([sys.executable, "launch.py", "--model", "studio-test/tiny-GGUF:Q5_K_M", "--port", "0"],
                             env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "error: studio-test/tiny-GGUF has no GGUF file tagged Q5_K_M: its GGUF files are tiny-F16.gguf, "
        "tiny-Q8_0.gguf"], bad.stderr
