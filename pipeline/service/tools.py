"""Tools loaded on first use and kept under a memory budget (`--gpu-memory`).

Why: a 7B chat model, a 7B Vicuna, EVA ViT-g and SAM-H take about 33 GB in bf16, more than the
8–24 GB cards most people have. So no tool loads before it is asked for (start-up loads only the
chat), and before a tool loads, the least recently used *idle* tools are unloaded until its size
fits the budget, each with a notice. A tool is idle when no request is using it (`using`); a tool
that another needs (image chat over the chat's own LLM, when both name the same weights) is unloaded
only together with it. A request for an unloaded tool loads it again, reporting progress to whoever
asked.

Sizes: the device memory a load allocated (on a GPU, the allocator's count; on the CPU, the bytes of
the tensors it holds that no other loaded tool holds), measured at each load; before a tool's first
load, an estimate from its weight files (floats at the width they load in, int8/int4 LLMs at their
quantized size: `studio.compose.tool_specs`). A tool estimated over the budget is still loaded when
nothing else is left to unload.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import gc
import threading
import time
import types
from collections.abc import Callable, Iterator
from typing import Protocol

import torch

from pipeline.errors import UserError

Say = Callable[[str], None]


class Tool(enum.StrEnum):
    """The studio's tools, by the names users read (status JSON and stored conversations carry them too)."""

    CHAT = "chat"
    IMAGE_CHAT = "image chat"
    SEGMENT = "segment"

    @property
    def flag(self) -> str:
        """The name in command-line options and identifiers: "image-chat"."""
        return self.value.replace(" ", "-")

GIB = 2**30
BUDGET_MARGIN = 2 * GIB  # left free on a GPU by the default budget: the CUDA context, allocator slack


_NOT_WALKED = (str, bytes, bytearray, int, float, complex, bool, type(None), type, types.ModuleType,
               types.FunctionType, types.MethodType, types.BuiltinFunctionType, threading.Thread)


def cpu_storages(root: object) -> dict[int, int]:
    """The CPU tensor storages reachable from `root` through attributes and containers (a module's
    parameters and buffers among them), by address: the CPU's stand-in for the GPU allocator's count.
    Why a walk and not `gc.get_objects()`: the garbage collector's list hands out other threads'
    half-built objects, and CPython then fails to finish them (a concurrent request died with
    "tupleobject.c: bad argument to internal function" while a tool loaded)."""
    storages: dict[int, int] = {}
    seen: set[int] = set()
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _NOT_WALKED):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            # exact types: subclasses include the exporter's fake tensors, which have no storage
            if type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.device.type == "cpu":
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        else:
            stack.extend(getattr(obj, "__dict__", {}).values())
            stack.extend(getattr(obj, name) for name in getattr(type(obj), "__slots__", ()) if hasattr(obj, name))
    return storages


def size_text(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB // 4 else f"{n / 2**20:.0f} MiB"


def default_budget(device: torch.device) -> int | None:
    """The whole card minus a margin on a GPU; no limit on the CPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory - BUDGET_MARGIN


class LoadedTool(Protocol):
    """What the host needs of a tool's pipeline (`ChatPipeline`, `ImageChatPipeline`, `SegmentPipeline`):
    what to call it (`title`: the model, for the page's header; `description`: how it runs too, in the
    engine's terms), and how to let go of its memory."""

    title: str
    description: str
    is_demo: bool

    def close(self) -> None: ...


@dataclasses.dataclass
class ToolSpec:
    """How to load a tool: `load(say, free_bytes)` returns its pipeline (with a `close()`), telling
    `say` (the requester) how it goes; `free_bytes` is what the budget leaves (None: no budget);
    `estimate` is its expected size before it has ever loaded; `needs` are tools it uses (loaded first);
    `notice`: what the UI says about its model (the small built-in chat model)."""

    name: Tool
    load: Callable[[Say, int | None], LoadedTool]
    estimate: int
    needs: tuple[Tool, ...] = ()
    is_demo: bool = False
    notice: str = ""


@dataclasses.dataclass(eq=False)  # compared by identity: a replaced slot is told apart from its successor
class _Slot:
    spec: ToolSpec
    pipeline: LoadedTool | None = None
    size: int | None = None  # measured at its last load
    busy: int = 0
    last_used: float = 0.0
    loads: int = 0
    load_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


class ToolHost:
    def __init__(self, device: torch.device, budget: int | None, say: Say):
        """`say` hears every load and unload (the terminal and the start-up report); `budget` None = no limit."""
        self.device, self.budget, self.say = device, budget, say
        self._slots: dict[str, _Slot] = {}
        self._retiring: list[_Slot] = []  # replaced while requests still used them: closed when the last ends
        self._lock = threading.RLock()  # bookkeeping only: never held during a load
        self._loading = threading.Lock()  # one load (and its memory measurement) at a time

    def add(self, spec: ToolSpec) -> None:
        self._slots[spec.name] = _Slot(spec)

    @property
    def names(self) -> list[str]:
        return list(self._slots)

    def spec(self, name: str) -> ToolSpec:
        return self._slots[name].spec

    def loaded(self, name: str) -> LoadedTool | None:
        """The tool's pipeline if it is loaded now, else None (never loads)."""
        return self._slots[name].pipeline

    def loads(self, name: str) -> int:
        """How many times the tool has been loaded (reloads after an unload included)."""
        return self._slots[name].loads

    @contextlib.contextmanager
    def using(self, name: str, say: Say | None = None) -> Iterator[LoadedTool]:
        """The tool's pipeline, loaded if needed (progress to `say` too); the tool, and the tools it
        needs, count as busy until the block ends, so they are not unloaded under a request."""
        while True:
            pipeline = self._ensure(name, say)
            with self._lock:  # still loaded (an unload or a switch may have come between): hold it busy
                slots = [self._slots[n] for n in self._with_needs(name)]
                if all(s.pipeline is not None for s in slots) and slots[0].pipeline is pipeline:
                    for slot in slots:
                        slot.busy += 1
                        slot.last_used = time.monotonic()
                    break
        try:
            yield pipeline
        finally:
            with self._lock:  # the slots held, even if a switch has replaced them since
                for slot in slots:
                    slot.busy -= 1
                    slot.last_used = time.monotonic()
                    if not slot.busy and slot in self._retiring:
                        self._retire(slot)

    def replace(self, specs: list[ToolSpec], why: str) -> None:
        """Tools loaded from now on by `specs` (a model switch): each replaced tool that is loaded is
        unloaded, at once when idle, else when the last request using it ends (requests in flight
        finish on the old model). Replace a tool's dependents with it (their pipelines hold it)."""
        with self._lock:
            for spec in specs:
                old = self._slots[spec.name]
                self._slots[spec.name] = _Slot(spec, loads=old.loads)
                if old.pipeline is None:
                    continue
                self._retiring.append(old)
                if not old.busy:
                    self._retire(old)
                else:
                    self.say(f"{spec.name}: the {old.busy} request(s) in progress finish on the old model ({why})")

    def _retire(self, slot: _Slot) -> None:
        self._retiring.remove(slot)
        slot.pipeline.close()
        slot.pipeline = None
        self._free()
        self.say(f"unloaded the old {slot.spec.name} ({size_text(slot.size)}): replaced")

    def load(self, name: str, say: Say | None = None) -> LoadedTool:
        """Load `name` now (start-up, `--preload`), without holding it busy."""
        return self._ensure(name, say)

    def unload(self, name: str, why: str) -> None:
        """Unload `name` and the loaded tools that need it (all must be idle)."""
        with self._lock:
            for n in self._dependents(name) + [name]:
                slot = self._slots[n]
                if slot.pipeline is None:
                    continue
                if slot.busy:
                    raise UserError(f"{n} is in use")
                slot.pipeline.close()
                slot.pipeline = None
                self._free()
                self.say(f"unloaded {n} ({size_text(slot.size)}) {why}")

    def status(self) -> dict[str, str]:
        """Per tool: "ready (X GiB of memory)", "in use", or "not loaded" (for the UI and /engine_status)."""
        out = {}
        for name, slot in self._slots.items():
            if slot.pipeline is None:
                out[name] = "not loaded" + (" (unloaded; loads again when used)" if slot.loads else "")
            else:
                out[name] = ("in use" if slot.busy else "ready") + f" ({size_text(slot.size)} of memory)"
        return out

    def close(self) -> None:
        """Unload every tool, their memory given back now (engines hold reference cycles)."""
        with self._lock:
            for slot in [*self._slots.values(), *self._retiring]:
                if slot.pipeline is not None:
                    slot.pipeline.close()
                    slot.pipeline = None
            self._free()

    # ---- bookkeeping (the callers hold the lock, except where said) ----------------------------

    def _free(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _with_needs(self, name: str) -> list[str]:
        names = [name]
        for need in self._slots[name].spec.needs:
            names += self._with_needs(need)
        return names

    def _dependents(self, name: str) -> list[str]:
        return [n for n, s in self._slots.items() if name in self._with_needs(n)[1:] and s.pipeline is not None]

    def _in_use(self) -> int:
        """The loaded tools' measured sizes (replaced ones still finishing requests too), plus what their
        caches hold now (`held_bytes`)."""
        return sum((s.size or 0) + (s.pipeline.held_bytes() if hasattr(s.pipeline, "held_bytes") else 0)
                   for s in [*self._slots.values(), *self._retiring] if s.pipeline is not None)

    def _ensure(self, name: str, say: Say | None) -> LoadedTool:
        """The loaded pipeline of `name`, loading it (and what it needs) first if it is not; called
        without the host's lock, which it takes only around bookkeeping."""
        slot = self._slots[name]
        if slot.pipeline is not None:
            return slot.pipeline
        for need in slot.spec.needs:
            self._ensure(need, say)
        with slot.load_lock:  # a second first request waits here, then finds it loaded
            if slot.pipeline is not None:
                return slot.pipeline
            with self._loading:
                return self._load(name, say)

    def _load(self, name: str, say: Say | None) -> LoadedTool:
        slot = self._slots[name]

        def tell(line: str) -> None:
            self.say(line)
            if say is not None and say is not self.say:  # a requester who is the host's own listener hears it once
                say(line)

        with self._lock:
            expected = slot.size if slot.size is not None else slot.spec.estimate
            self._make_room(name, expected, tell)
            free = None if self.budget is None else self.budget - self._in_use()
        tell(f"loading {name}" + (" again" if slot.loads else "") + "…")
        before, start = self._allocated(), time.perf_counter()
        try:
            pipeline = slot.spec.load(say or (lambda line: None), free)
        except torch.OutOfMemoryError:
            gc.collect()
            raise UserError(f"the GPU ran out of memory loading {name}: lower --gpu-memory's other tools' share "
                            f"(--quant int4), or use the tools one at a time") from None
        size = max(self._allocated() - before, 0) if self.device.type == "cuda" else self._cpu_bytes(name, pipeline)
        with self._lock:
            slot.pipeline, slot.size = pipeline, size
            slot.loads += 1
            slot.last_used = time.monotonic()
            memory = "of GPU memory" if self.device.type == "cuda" else "of memory"
            tell(f"{name} ready in {time.perf_counter() - start:.1f} s ({size_text(slot.size)} {memory})")
            if self.budget is not None and self._in_use() > self.budget:
                self._make_room(name, 0, tell)
        return pipeline

    def _allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0

    def _cpu_bytes(self, name: str, pipeline: object) -> int:
        """The tensor bytes `pipeline` holds that no other loaded tool holds (image chat over the chat's
        own LLM counts only its vision part)."""
        with self._lock:
            others = [s.pipeline for n, s in self._slots.items() if n != name and s.pipeline is not None]
        shared: set[int] = set()
        for other in others:
            shared.update(cpu_storages(other))
        return sum(nbytes for address, nbytes in cpu_storages(pipeline).items() if address not in shared)

    def _make_room(self, name: str, needed: int, tell: Say) -> None:
        """Unload least recently used idle tools until `needed` more bytes fit the budget."""
        if self.budget is None:
            return
        keep = set(self._with_needs(name))
        while self._in_use() + needed > self.budget:
            idle = [(s.last_used, n) for n, s in self._slots.items()
                    if s.pipeline is not None and n not in keep and not s.busy
                    and not any(self._slots[d].busy for d in self._dependents(n))]
            if not idle:
                held = ", ".join([f"{n} {size_text(s.size)}" + (" in use" if s.busy else "")
                                  for n, s in self._slots.items() if s.pipeline is not None] +
                                 [f"the old {s.spec.name} {size_text(s.size)} finishing requests" for s in self._retiring])
                if self._slots[name].pipeline is not None:  # loaded, and over: say so, keep serving
                    tell(f"over the {size_text(self.budget)} budget ({held}): nothing idle to unload")
                    return
                if not held:  # alone over the budget: an estimate from files (quantized or down-cast weights
                    # take less), or a size the budget has changed under since. Try; the load measures it.
                    tell(f"{name} may need {size_text(needed)}, more than the {size_text(self.budget)} budget; "
                         f"nothing else is loaded, so loading it anyway")
                    return
                raise UserError(f"{name} needs about {size_text(needed)} but the {size_text(self.budget)} "
                                f"GPU budget is held by tools in use ({held}); try again when they finish, "
                                f"or raise --gpu-memory")
            _, victim = min(idle)
            self.unload(victim, f"to make room for {name} under the {size_text(self.budget)} budget")
