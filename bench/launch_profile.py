"""Where a launch's time goes: every Triton compile (which kernel, on which thread, how long) and a sampling
profile of the loader's threads (what they were doing, 20 times a second). Used by `decode_limit.py`'s
launch part, in each launch's own process.

    with LaunchProfile() as profile:
        ...load...
    profile.summary()  # JSON-ready
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from pathlib import Path

from triton.runtime import _async_compile

ROOT = str(Path(__file__).resolve().parents[1])
CONSTEXPRS = ("ROWS", "BLOCK_M", "BLOCK_N", "STEPS", "TOKENS", "LANES", "BITS", "GATED", "C", "K")


class LaunchProfile:
    def __init__(self, interval: float = 0.05):
        self.interval, self.t0 = interval, time.perf_counter()
        self.compiles: dict[tuple, dict] = {}
        self.samples: collections.Counter = collections.Counter()
        self.timeline: list[tuple[float, str]] = []
        self._stop = threading.Event()

    # Triton's hooks: a compile is asked for (not in memory: compiled, or read from the disk cache) and done
    def _asked(self, *, key, repr, fn, compile, is_manual_warmup, already_compiled):
        names = fn.jit_function.arg_names
        consts = {names[k[0]] if isinstance(k, tuple) and len(k) == 1 else str(k): v
                  for k, v in compile["constants"].items()}
        name = fn.name + "".join(f" {c}={consts[c]}" for c in CONSTEXPRS if c in consts)
        self.compiles[(fn.name, str(key))] = {"kernel": name, "thread": threading.current_thread().name,
                                              "asked_s": round(time.perf_counter() - self.t0, 2),
                                              "async": _async_compile.active_mode.get() is not None,
                                              "key": str(key)[:400]}
        return None

    def _done(self, *, key, repr, fn, compile, is_manual_warmup, already_compiled):
        entry = self.compiles.get((fn.name, str(key)))
        if entry is not None:
            entry["done_s"] = round(time.perf_counter() - self.t0, 2)
        return None

    def _sample(self) -> None:
        main = threading.main_thread().ident
        while not self._stop.wait(self.interval):
            now = round(time.perf_counter() - self.t0, 1)
            for ident, frame in sys._current_frames().items():
                thread = next((t for t in threading.enumerate() if t.ident == ident), None)
                if thread is None or not (ident == main or thread.name.startswith("llm")):
                    continue
                ours, innermost = [], None
                while frame is not None:
                    where = frame.f_code.co_filename
                    if innermost is None:
                        innermost = f"{Path(where).name}:{frame.f_code.co_name}"
                    if where.startswith(ROOT) and "/.venv/" not in where and "launch_profile" not in where:
                        ours.append(f"{Path(where).stem}.{frame.f_code.co_name}")
                    frame = frame.f_back
                label = f"{thread.name[:12]}: " + " < ".join(ours[:3]) + f" [{innermost}]"
                self.samples[label] += 1
                if ident == main and (not self.timeline or self.timeline[-1][1] != " < ".join(ours[:2])):
                    self.timeline.append((now, " < ".join(ours[:2])))

    def __enter__(self) -> "LaunchProfile":
        from triton import knobs

        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._asked, self._done
        self._thread = threading.Thread(target=self._sample, daemon=True, name="profiler")
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        from triton import knobs

        self._stop.set()
        self._thread.join()
        knobs.runtime.jit_cache_hook = knobs.runtime.jit_post_compile_hook = None

    def summary(self, top: int = 25) -> dict:
        """Compiles by kernel (count, and the seconds those compiled one at a time took: time the thread
        that asked waited), the slowest such compiles, and the sampled profile's top entries in seconds."""
        by_kernel: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
        waited = []
        for c in self.compiles.values():
            base = c["kernel"].split(" ")[0]
            by_kernel[base][0] += 1
            if not c["async"] and "done_s" in c:
                took = c["done_s"] - c["asked_s"]
                by_kernel[base][1] = round(by_kernel[base][1] + took, 2)
                waited.append((round(took, 2), c["asked_s"], c["thread"], c["kernel"], c["key"]))
        return {"compiles": len(self.compiles),
                "compiles_by_kernel (count, s compiled one at a time)": dict(by_kernel),
                "slowest_one_at_a_time_compiles (s, at_s, thread, kernel, key)": sorted(waited, reverse=True)[:top],
                "sampled_s": {k: round(v * self.interval, 2) for k, v in self.samples.most_common(top)},
                "main_thread_timeline": self.timeline[:200]}
