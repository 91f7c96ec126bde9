"""The app as a CPU, macOS or Windows install gets it: torch without triton. Every product module must
import, and the launcher must answer, with `triton` unimportable (the README's first command died on
an unguarded kernel import that the dev install, which has triton, never saw)."""

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("app", "studio", "engine_builder", "pipeline", "plugins")

# A meta-path finder placed first: `import triton` (and any submodule) fails as it does without the wheel.
NO_TRITON = textwrap.dedent("""
    import sys
    class NoTriton:
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ImportError(f"No module named {name!r} (made unimportable by the test)")
            return None
    sys.meta_path.insert(0, NoTriton())
""")


def run_without_triton(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", NO_TRITON + textwrap.dedent(code), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def product_modules() -> list[str]:
    names = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_every_product_module_imports_without_triton():
    modules = product_modules()
    assert "plugins.lowbit" in modules and "launch" not in modules
    done = run_without_triton("""
        import importlib, sys
        failed = []
        for name in sys.argv[1:] + ["launch"]:
            try:
                importlib.import_module(name)
            except Exception as e:
                failed.append(f"{name}: {type(e).__name__}: {e}")
        assert "triton" not in sys.modules, "triton was imported after all"
        print("\\n".join(failed) if failed else "all imported")
    """, *modules)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "all imported", done.stdout


def test_the_launcher_answers_without_triton():
    done = run_without_triton("""
        import runpy, sys
        sys.argv = ["launch.py", "--help"]
        runpy.run_path("launch.py", run_name="__main__")
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "--model" in done.stdout and "usage" in done.stdout.lower()
