"""The code's layers, checked from the source: each package imports only its own layer and those below,
nothing imports `launch`, and no module imports itself round a cycle.

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
    """(imported module, at module level) for every import in the file, lazy ones (in functions) too."""
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


def test_no_import_cycles():
    """Between modules, counting imports at module level (those run at import time); Tarjan's SCCs."""
    modules = {module_name(p): p for p in project_files() if module_name(p).split(".")[0] in LAYERS}
    graph = {m: sorted({n for name, top in imports(p) if top for n in (name, name.rsplit(".", 1)[0])
                        if n in modules and n != m}) for m, p in modules.items()}
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
    assert not cycles, cycles


PIPELINE_LAYERS = {"service": 3, "pipelines": 2, "llm": 1, "sam": 1, "minigpt4": 1, "models": 1}  # anything else: helpers (0)


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
