"""The engine cache: build an engine once, find it on every later launch, never trust a bad one.

An engine lives in one folder per *slot* (component + backend + weights location), so a new build
for the same slot replaces the old one in place and the reason is known ("the weights changed").
Beside the engine files, `meta.json` holds the full key the engine was built for (weights
fingerprint, precision, shape profile, builder and version, device and compute capability) and a
checksum of every file. A lookup takes the slot's file lock first, so a second launch waits for a
build in progress and then loads its result instead of building again; a build goes into a
temporary folder that replaces the slot only once complete, so a killed build leaves nothing a
later launch loads (its leftovers are removed under the lock).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from filelock import FileLock

from pipeline.files import atomic_folder, atomic_write, file_sha256

FORMAT = 1  # bump when the exported graphs change, so engines built from older graphs are rebuilt
META = "meta.json"

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class EngineKey:
    """Everything an engine depends on: a cached engine is used only when all of it matches."""

    component: str  # "sam_image_encoder", "sam_mask_decoder", "minigpt4_vision"
    source: str  # where the weights were read from (names the slot; not a match criterion)
    weights: str  # fingerprint of those weights' bytes
    precision: str  # "float32", "float16", "bfloat16"
    profile: dict  # input name → [min, opt, max] shapes
    builder: str  # "onnxruntime", "tensorrt"
    builder_version: str
    device: str  # GPU name and compute capability, or the CPU model
    format: int = FORMAT

    def slot(self) -> str:
        digest = hashlib.sha256(f"{self.component}|{self.builder}|{self.source}".encode()).hexdigest()[:12]
        return f"{self.component}-{self.builder}-{digest}"

    def differences(self, other: dict) -> list[str]:
        """The fields of an older key that differ from this one, as a user reads them."""
        names = {"weights": "the weights changed", "precision": "another precision", "profile": "other shapes",
                 "builder_version": "another builder version", "device": "another device",
                 "format": "an older export format"}
        mine = dataclasses.asdict(self)
        return [names.get(k, f"{k} differs") for k in mine if k != "source" and other.get(k) != mine[k]]


@dataclasses.dataclass
class CachedEngine:
    """An engine folder that matches its key, and how this launch came to have it."""

    folder: Path
    built: bool  # built now (False: loaded from the cache)
    seconds: float  # the build, or the lookup and checks
    reason: str  # why it was built ("not built yet", "the weights changed", ...) or "cached"
    verdict: Verdict | None = None  # its check against the torch reference (None: none asked for)

    def outcome(self) -> str:
        """"built in 41.2 s, verified (…)" or "loaded from cache in 0.31 s, verified (…)"."""
        how = f"built in {self.seconds:.1f} s" if self.built else f"loaded from cache in {self.seconds:.2f} s"
        return how + (f", {self.verdict.line()}" if self.verdict is not None else "")


class EngineBuildError(RuntimeError):
    """A build or the engine it produced failed; the caller falls back to another backend."""


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Whether an engine computed what the torch reference computes on fixed probe inputs: `check` names
    what was compared, `numbers` what came out against what was allowed."""

    passed: bool
    check: str
    numbers: str

    def line(self) -> str:
        return f"{'verified' if self.passed else 'refused'} ({self.check}: {self.numbers})"


def _stamp(path: Path) -> list[int]:
    stat = path.stat()
    return [stat.st_size, stat.st_mtime_ns, stat.st_ino]


def _check(folder: Path, key: EngineKey) -> str | None:
    """None when `folder` holds a complete engine for `key`, else why not.

    A file is hashed again only when its size, modification time or inode differ from when it was
    last verified (hashing a multi-gigabyte engine costs seconds per launch); a file that verifies
    under a new stamp (a copied cache) has its stamp updated."""
    try:
        meta = json.loads((folder / META).read_text())
    except FileNotFoundError:
        return "not built yet"
    except (OSError, ValueError):
        return "its metadata is unreadable"
    if meta.get("key") != json.loads(json.dumps(dataclasses.asdict(key))):
        return "built for " + ", ".join(key.differences(meta.get("key", {})) or ["another key"])
    restamped = False
    for name, expected in meta.get("files", {}).items():
        path = folder / name
        if not path.is_file() or path.stat().st_size != expected["bytes"]:
            return f"{name} is missing or truncated"
        if _stamp(path) != expected.get("stamp"):
            if file_sha256(path) != expected["sha256"]:
                return f"{name} is damaged (checksum mismatch)"
            expected["stamp"], restamped = _stamp(path), True
    if restamped:
        atomic_write(folder / META, json.dumps(meta, indent=1))
    return None


def _files_digest(meta: dict) -> str:
    """One hash of an engine's files (their checksums): a verdict holds for exactly these files."""
    files = meta.get("files", {})
    return hashlib.sha256("|".join(f"{n}:{files[n]['sha256']}" for n in sorted(files)).encode()).hexdigest()


def _read_meta(folder: Path) -> dict:
    return json.loads((folder / META).read_text())


def _verdict_of(folder: Path) -> Verdict | None:
    """The recorded verdict, if it was reached on the files now there."""
    meta = _read_meta(folder)
    recorded = meta.get("verdict")
    if not recorded or recorded.get("files") != _files_digest(meta):
        return None
    return Verdict(recorded["passed"], recorded["check"], recorded["numbers"])


class EngineCache:
    """Engines under one directory (`--engine-dir`); `rebuild=True` (`--rebuild`) ignores what is there,
    recorded failures and verdicts included.

    Nothing is trusted until it proves itself: with a `verify`, an engine is checked against the torch
    reference after it is built (and whenever its files changed since its verdict), and the verdict is
    kept in its metadata. A refused engine is never loaded again, and a failed build is not retried,
    until `--rebuild` or a change of key (new weights, builder version, device): both are remembered."""

    def __init__(self, root: Path, rebuild: bool = False):
        self.root = Path(root)
        self.rebuild = rebuild

    def folder(self, key: EngineKey) -> Path:
        return self.root / key.slot()

    def status(self, key: EngineKey) -> str:
        """Without building, for `--check`: what a launch would do with this engine, and its verdict."""
        if self.rebuild:
            return "will be built (--rebuild)"
        if (failed := self._failure(key)) is not None:
            return f"its build failed ({failed}): not retried until --rebuild"
        folder = self.folder(key)
        if (why := _check(folder, key)) is not None:
            return f"will be built ({why})"
        verdict = _verdict_of(folder)
        return f"cached in {folder}" + (f", {verdict.line()}" if verdict else ", not verified yet")

    def _failure_path(self, key: EngineKey) -> Path:
        return self.root / f"{key.slot()}.failed.json"

    def _failure(self, key: EngineKey) -> str | None:
        """Why the last build for exactly this key failed, if it did."""
        try:
            record = json.loads(self._failure_path(key).read_text())
        except (OSError, ValueError):
            return None
        return record.get("reason") if record.get("key") == json.loads(json.dumps(dataclasses.asdict(key))) else None

    def get(self, key: EngineKey, build: Callable[[Path, str], None], load: Callable[[Path], T],
            verify: Callable[[T], Verdict] | None = None) -> tuple[T, CachedEngine]:
        """Load the cached engine for `key`, building it first when missing, stale or damaged.

        `build(folder, reason)` writes the engine files into an empty folder; `load(folder)` opens them;
        `verify(engine)` checks it against the torch reference. An engine that fails to load is rebuilt
        once; if the fresh one fails too, or is refused, or the build fails, `EngineBuildError`.
        """
        folder = self.folder(key)
        self.root.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        with FileLock(str(folder) + ".lock"):
            for leftover in self.root.glob(folder.name + ".*"):  # temporary folders of killed builds
                if leftover.is_dir():
                    shutil.rmtree(leftover, ignore_errors=True)
            if not self.rebuild and (failed := self._failure(key)) is not None:
                raise EngineBuildError(f"its build failed before ({failed}); not retried until --rebuild")
            reason = "--rebuild" if self.rebuild else _check(folder, key)
            if reason is None:
                earlier = _verdict_of(folder) if verify is not None else None
                if earlier is not None and not earlier.passed:
                    raise EngineBuildError(f"{earlier.line()}; not used until --rebuild")
                try:
                    engine = load(folder)
                except Exception as e:  # noqa: BLE001: any load failure means the engine is unusable
                    reason = f"the cached engine failed to load ({type(e).__name__}: {e})"
                else:
                    verdict = self._trust(folder, engine, verify)
                    return engine, CachedEngine(folder, False, time.perf_counter() - start, "cached", verdict)
            try:
                self._build(folder, key, lambda tmp: build(tmp, reason))
                try:
                    engine = load(folder)
                except Exception as e:
                    shutil.rmtree(folder, ignore_errors=True)
                    raise EngineBuildError(f"the freshly built engine failed to load: {type(e).__name__}: {e}") from e
            except EngineBuildError as e:
                atomic_write(self._failure_path(key), json.dumps({"key": dataclasses.asdict(key), "reason": str(e),
                                                                  "at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}))
                raise
            self._failure_path(key).unlink(missing_ok=True)
            verdict = self._trust(folder, engine, verify)
            return engine, CachedEngine(folder, True, time.perf_counter() - start, reason, verdict)

    @staticmethod
    def _trust(folder: Path, engine: T, verify: Callable[[T], Verdict] | None) -> Verdict | None:
        """The engine's verdict: the recorded one if it was reached on these files, else a new check,
        recorded. Raises `EngineBuildError` for a refused engine."""
        if verify is None:
            return None
        verdict = _verdict_of(folder)
        if verdict is None:
            verdict = verify(engine)
            meta = _read_meta(folder)
            meta["verdict"] = {**dataclasses.asdict(verdict), "files": _files_digest(meta),
                               "at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
            atomic_write(folder / META, json.dumps(meta, indent=1))
        if not verdict.passed:
            raise EngineBuildError(f"{verdict.line()}; not used until --rebuild")
        return verdict

    @staticmethod
    def _build(folder: Path, key: EngineKey, build: Callable[[Path], None]) -> None:
        try:
            with atomic_folder(folder) as tmp:
                build(tmp)
                # a rename keeps size, modification time and inode: the stamps hold for the final folder
                files = {p.name: {"bytes": p.stat().st_size, "sha256": file_sha256(p), "stamp": _stamp(p)}
                         for p in sorted(tmp.iterdir()) if p.is_file()}
                meta: dict[str, Any] = {"key": dataclasses.asdict(key), "files": files,
                                        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
                atomic_write(tmp / META, json.dumps(meta, indent=1))
        except EngineBuildError:
            raise
        except Exception as e:
            raise EngineBuildError(f"{type(e).__name__}: {e}") from e
