"""The code's layers and seams, checked from the source: each package imports only its own layer and
those below, nothing imports `launch`, no module imports itself round a cycle (counting every import:
inside functions and under `TYPE_CHECKING` too), imports are at the top of the module but for the few
on the allow-list, no product file runs past 400 lines, and nothing in the request path polls.

    launch.py → app (UI and API translators) → studio (the composition root) → engine_builder → pipeline → plugins
"""

import ast
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"launch": 5, "app": 4, "studio": 3, "engine_builder": 2, "pipeline": 1, "plugins": 0}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[str, bool]]:
    """(imported module, at module level) for every import in the file, lazy ones (in functions, or under
    `if TYPE_CHECKING:`) too."""
    tree = ast.parse(path.read_text(), str(path))
    top = {id(node) for node in tree.body}
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, id(node) in top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            name = ".".join(base + ([node.module] if node.module else []))
            found += [(name, id(node) in top)] + [(f"{name}.{alias.name}", id(node) in top) for alias in node.names]
    return found


def project_files() -> list[Path]:
    files = [ROOT / "launch.py"]
    for folder in ("app", "studio", "engine_builder", "pipeline", "plugins", "tests", "bench", "scripts"):
        files += sorted((ROOT / folder).rglob("*.py"))
    return [f for f in files if ".venv" not in f.parts]


def test_no_package_imports_a_layer_above_it_and_nothing_imports_launch():
    wrong = []
    for path in project_files():
        own = module_name(path).split(".")[0]
        for name, _ in imports(path):
            target = name.split(".")[0]
            if target == "launch":
                wrong.append(f"{path.relative_to(ROOT)} imports launch")
            elif own in LAYERS and target in LAYERS and LAYERS[target] > LAYERS[own]:
                wrong.append(f"{path.relative_to(ROOT)} ({own}) imports {name} ({target}: a layer above)")
    assert not wrong, "\n".join(wrong)


def import_graph(top_only: bool = False) -> dict[str, list[str]]:
    """Module → the project modules it imports (every import, or with `top_only` those at module level)."""
    modules = {module_name(p): p for p in project_files() if module_name(p).split(".")[0] in LAYERS}
    return {m: sorted({n for name, top in imports(p) if top or not top_only for n in (name, name.rsplit(".", 1)[0])
                       if n in modules and n != m}) for m, p in modules.items()}


def cycles_of(graph: dict[str, list[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles_counting_every_import():
    assert not cycles_of(import_graph()), cycles_of(import_graph())


def test_the_cycle_check_sees_imports_inside_functions():
    """A cycle closed only by an import inside a function is still a cycle (the old check missed three)."""
    graph = import_graph()
    graph["pipeline.errors"] = [*graph["pipeline.errors"], "studio.compose"]  # as if errors.py imported it lazily
    assert cycles_of(graph) and not cycles_of(import_graph(top_only=True))


# The only imports of project modules not at the top of a product module, and why each waits.
DEFERRED = {
    ("launch", "app.server"): "gradio takes seconds to import: the terminal chat starts without it",
    **{pair: "Triton kernels and their jit helpers exist only where triton imports (CPU wheels have none)"
       for pair in (("plugins.lowbit", "plugins.lowbit_gemv"), ("plugins.lowbit", "plugins.lowbit_tiles"),
                    ("plugins.lowbit_gemv", "plugins.lowbit_tiles"), ("plugins.gguf_matmul", "plugins.lowbit_tiles"),
                    ("plugins.gguf_matmul", "plugins.gguf_gemv"), ("plugins.gguf_gemv", "plugins.lowbit_tiles"))},
}
PRODUCT = ("app", "studio", "engine_builder", "pipeline", "plugins")


def product_files() -> list[Path]:
    return [ROOT / "launch.py"] + [f for folder in PRODUCT for f in sorted((ROOT / folder).rglob("*.py"))]


def test_imports_of_project_modules_are_at_the_top_but_for_the_allow_list():
    """Inside functions and under `if TYPE_CHECKING:` alike (neither runs at import time, both hide the structure)."""
    deferred = {(module_name(path), name) for path in product_files() for name, top in imports(path)
                if not top and name.split(".")[0] in LAYERS}
    unlisted = {(m, n) for m, n in deferred if not any(m == mm and (n == d or n.startswith(d + "."))
                                                        for mm, d in DEFERRED)}
    assert not unlisted, sorted(unlisted)
    assert len(DEFERRED) <= 15


def test_no_product_file_is_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in product_files() if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long


POLLING_CALLS = {"sleep", "wait", "get", "join", "await_responses", "wait_for"}


def short_waits(path: Path) -> list[str]:
    """Calls in `path` that wait under 0.1 s (`sleep(0.005)`, `get(timeout=0.05)`, a timedelta of 2 ms):
    the signs of a polling loop."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        seconds = None
        if name == "timedelta" and node.keywords and all(isinstance(k.value, ast.Constant) for k in node.keywords):
            units = {"seconds": 1, "milliseconds": 1e-3, "microseconds": 1e-6}
            seconds = sum(k.value.value * units.get(k.arg, 0) for k in node.keywords)
        elif name in POLLING_CALLS:
            values = [k.value for k in node.keywords if k.arg == "timeout"] + \
                     (node.args[:1] if name in ("sleep", "wait", "wait_for") else [])
            numbers = [v.value for v in values if isinstance(v, ast.Constant) and isinstance(v.value, (int, float))
                       and not isinstance(v.value, bool)]
            seconds = min(numbers) if numbers else None
        if seconds is not None and seconds < 0.1:
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_nothing_in_the_request_path_polls():
    found = [line for path in product_files() for line in short_waits(path)]
    assert not found, found


def test_the_polling_check_finds_a_poll(tmp_path):
    poll = tmp_path / "poll.py"
    poll.write_text("import asyncio, datetime\nasync def f(q):\n    while q.empty():\n        await asyncio.sleep(0.005)\n"
                    "def g(q):\n    return q.get(timeout=0.05), datetime.timedelta(milliseconds=2)\n")
    assert len(short_waits(poll)) == 3


PIPELINE_LAYERS = {"service": 3, "pipelines": 2, "docs": 2, "llm": 1, "embed": 1, "speech": 1, "sam": 1, "minigpt4": 1,
                   "smolvlm": 1, "qwen_vl": 1, "models": 1}  # anything else: helpers (0)


def test_inside_pipeline_each_layer_imports_only_those_below_it():
    """The service over the pipelines over the model code and engines over the shared helpers."""
    def layer(module: str) -> int:
        parts = module.split(".")
        return PIPELINE_LAYERS.get(parts[1], 0) if len(parts) > 1 else 0

    wrong = []
    for path in sorted((ROOT / "pipeline").rglob("*.py")):
        own = module_name(path)
        for name, _ in imports(path):
            if name.startswith("pipeline.") and layer(name) > layer(own):
                wrong.append(f"{own} imports {name}")
    assert not wrong, "\n".join(wrong)


# Inside pipeline/llm/, lowest first: the text (tokenizers, prompts and the `Prompt` engines take), the
# weights (configs and checkpoint formats, which write tokenizer files), the decoder and its loading
# from a checkpoint, the engine; anything else there (language_model, remote, evaluate, demo) above them all.
LLM_LAYERS = {"text": 0, "weights": 1, "model": 2, "engine": 3}
LLM_REST = 4


def llm_sublayer(module: str) -> tuple[int, str] | None:
    """(rank, name) of a module's sub-layer of `pipeline/llm/`; None outside it."""
    parts = module.split(".")
    if parts[:2] != ["pipeline", "llm"]:
        return None
    name = parts[2] if len(parts) > 2 and parts[2] in LLM_LAYERS else "the rest of pipeline/llm"
    return LLM_LAYERS.get(name, LLM_REST), name


def test_inside_pipeline_llm_each_sub_layer_imports_only_those_below_it():
    """Every import counts (inside functions and under `TYPE_CHECKING` too), named as precisely as it is
    written: `from pipeline.llm.engine.seam import X` is an import of `...seam.X`."""
    wrong = []
    for path in sorted((ROOT / "pipeline" / "llm").rglob("*.py")):
        own = llm_sublayer(module_name(path))
        names = {name for name, _ in imports(path)}
        for name in sorted(n for n in names if not any(m.startswith(n + ".") for m in names)):
            target = llm_sublayer(name)
            if target is not None and target[0] > own[0]:
                wrong.append(f"{path.relative_to(ROOT)} imports {name}: {own[1]} may not import {target[1]}, "
                             f"a sub-layer above it")
    assert not wrong, "\n".join(wrong)


def test_the_engines_contract_and_the_remote_client_import_no_torch():
    """`--llm-endpoint` chats through another server: its client, the engine's contract (`seam.py`) and the
    sampling parameters (`params.py`) load with torch made unimportable, so they pull in none of it."""
    import subprocess
    import sys

    code = ("import importlib.abc, sys\n"
            "class NoTorch(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] == 'torch':\n"
            "            raise ImportError(f'{name} is imported')\n"
            "sys.meta_path.insert(0, NoTorch())\n"
            "import pipeline.llm.engine.seam, pipeline.llm.engine.params, pipeline.llm.remote\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_launch_does_not_import_torchs_compiler():
    """torch._dynamo (torch.compile's front end) takes about 1.8 s to import and no launch runs it: the app's
    modules load without it (it came in through `torch.nn.attention.bias`, which a picture's prefill imports
    when it first runs)."""
    import subprocess
    import sys

    code = "import sys, launch\nprint(sorted(m for m in sys.modules if m.startswith('torch._dynamo'))[:3])"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "[]", (done.stdout, done.stderr[-2000:])


def test_a_decoders_structure_on_the_meta_device_imports_no_compiler_and_has_the_decoders_shapes():
    """`empty_decoder`, the structure every load (and the memory estimate) starts from: `nn.init`'s fills on
    the meta device imported torch._dynamo and sympy (4.6 s of a second launch on an H200 machine); it
    skips them and keeps every parameter's shape and dtype."""
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "from pipeline.llm.model.decoder import Decoder\n"
            "from pipeline.llm.model.loading import empty_decoder\n"
            "from pipeline.llm.weights.config import config_from_hf\n"
            "c = config_from_hf(dict(architectures=['Qwen2ForCausalLM'], hidden_size=64, intermediate_size=128,"
            " num_attention_heads=4, num_hidden_layers=2, num_key_value_heads=2, vocab_size=300,"
            " max_position_embeddings=256, model_type='qwen2'))\n"
            "meta = {k: (v.shape, v.dtype, v.device.type) for k, v in empty_decoder(c, torch.bfloat16).state_dict().items()}\n"
            "compiler = 'torch._dynamo' in sys.modules\n"
            "real = {k: (v.shape, v.dtype, 'meta') for k, v in Decoder(c).to(torch.bfloat16).state_dict().items()}\n"
            "print(compiler, meta == real, len(meta))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.split() == ["False", "True", done.stdout.split()[-1]] \
        and int(done.stdout.split()[-1]) > 10, (done.stdout, done.stderr[-2000:])


def test_speculation_sits_behind_the_schedulers_seam_and_the_engine_loop_stays_small():
    """Speculative decoding is named (drafts, speculation) in at most 4 of the engine's files: its policy, the
    scheduler that owns the drafts, the engine that wires them and the contract's statistics. The plan, the
    runner, the sampler and the settlement know only of proposed tokens a step verifies; the model layer knows
    nothing of either. The engine's loop stays under 300 lines."""
    import re

    engine = ROOT / "pipeline" / "llm" / "engine"
    naming = sorted(p.name for p in engine.glob("*.py") if re.search(r"specul|draft", p.read_text(), re.IGNORECASE))
    assert len(naming) <= 4 and not {"plan.py", "model_runner.py", "sampler.py", "outputs.py"} & set(naming), naming
    model = [p.name for p in (ROOT / "pipeline" / "llm" / "model").glob("*.py")
             if re.search(r"specul|draft", p.read_text(), re.IGNORECASE)]
    assert not model, model
    assert len((engine / "torch_engine.py").read_text().splitlines()) <= 300
