"""Models' files: downloading one from the hub (progress, Cancel, resume) and deleting one (after asking).

Kept apart from finding (`model_finder.py`) and switching (`model_catalog.py`): these change the disk,
and each ends by making the finder look again.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable
from pathlib import Path

from huggingface_hub import scan_cache_dir, snapshot_download
from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError, RevisionNotFoundError

from pipeline.errors import UserError
from pipeline.models import HUB_FILES, HUB_GGUF, ModelEntry, cache_dir, hub_gguf_files, locate
from pipeline.service.tools import Tool, size_text
from studio.hub_progress import DownloadCancelled, cancelled, progress_class
from studio.model_finder import ModelFinder


# the models chosen at launch (no switch in the Models tab) by what uses them → the option that chooses them
SET_AT_LAUNCH = {"documents' embedder": "--embedder", "documents' reranker": "--reranker",
                 "speech to text": "--stt", "voice": "--voice"}


class ModelFiles:
    """Downloads and deletes; `in_use()` says which model each part of the app runs (never deleted from under it)."""

    def __init__(self, finder: ModelFinder, in_use: Callable[[], dict[str, str | None]], say: Callable[[str], None]):
        self.finder, self.in_use, self.say = finder, in_use, say

    def download(self, repo_id: str, say: Callable[[str], None], cancel: threading.Event) -> Path:
        """Fetch `repo_id`'s config, tokenizer and weights into the Hugging Face cache with huggingface_hub's
        client, progress to `say`; for `owner/repo:TAG`, just the GGUF file that tag picks (every part).
        A connection dropped mid-file resumes from the bytes it has (HTTP Range); after a cancel or a
        failure, the files already complete are kept and not fetched again."""
        repo_id = (repo_id or "").strip()
        if not repo_id:
            raise UserError("type a Hugging Face model id, like Qwen/Qwen2.5-0.5B-Instruct, or a GGUF repository "
                            "and tag, like Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M")
        tagged = HUB_GGUF.match(repo_id)
        repo = tagged["repo"] if tagged else repo_id
        try:
            files = hub_gguf_files(repo, tagged["tag"]) if tagged else HUB_FILES
            path = Path(snapshot_download(repo, allow_patterns=files, tqdm_class=progress_class(say, cancel)))
        except UserError:
            raise
        except HFValidationError:
            raise UserError(f"{repo_id!r} is not a Hugging Face model id: it looks like owner/name (or "
                            f"owner/name:TAG for a GGUF file)") from None
        except (RepositoryNotFoundError, RevisionNotFoundError):
            raise UserError(f"there is no model {repo_id} on the hub (or it is private: sign in with "
                            f"`hf auth login`)") from None
        except GatedRepoError:
            raise UserError(f"{repo_id} is gated: accept its terms on huggingface.co and sign in with "
                            f"`hf auth login`") from None
        except DownloadCancelled:
            raise cancelled(repo_id, "download it again") from None
        except Exception as e:  # offline, disk full, a dropped connection retried too often
            first = str(e).splitlines()[0] if str(e) else "no details"
            raise UserError(f"could not download {repo_id} ({type(e).__name__}: {first[:200]}); downloading "
                            f"it again fetches only the files still missing") from None
        self.finder.refresh()
        if tagged:
            return path / files[0]
        if not (path / "config.json").is_file():
            raise UserError(f"{repo_id} has no config.json: it is not a model this app can run")
        return path

    def delete_plan(self, model_id: str) -> tuple[ModelEntry, str]:
        """What deleting `model_id` would remove, as the question asked before doing it."""
        entry = self.finder.entry(model_id)
        for user, current in self.in_use().items():
            if self._runs(entry, current):
                if user in iter(Tool):
                    raise UserError(f"{entry.id} is the {user} model now: switch {user} to another model first")
                raise UserError(f"{entry.id} is the {user} now: start the app with another {SET_AT_LAUNCH[user]} "
                                f"first")
        if not entry.deletable:
            raise UserError(f"{entry.id} is {entry.source}: it is not a download this app manages")
        where = "the Hugging Face cache" if entry.source == "Hugging Face cache" else \
            ", ".join(map(str, entry.files)) if entry.files else str(entry.path)
        return entry, f"Delete {entry.id} ({size_text(entry.disk_bytes)}) from {where}?"

    @staticmethod
    def _runs(entry: ModelEntry, current: str | None) -> bool:
        """Whether the model a tool runs, `current` (as it was given), is `entry`'s: its id or path, or for
        a GGUF model any id that `locate` makes the same model folder of (`owner/repo:q4_k_m`)."""
        if current is None:
            return False
        if current == entry.id or (entry.path is not None and current == str(entry.path)):
            return True
        if not entry.files or entry.path is None:
            return False
        try:
            return locate(current).path == entry.path
        except Exception:  # noqa: BLE001 - a model that is not there any more is not this one
            return False

    def delete(self, model_id: str) -> str:
        """Remove `model_id`'s files (after `delete_plan` was shown and confirmed)."""
        entry, _ = self.delete_plan(model_id)
        if entry.files:
            self._delete_gguf(entry)
        elif entry.source == "Hugging Face cache":
            repos = [r for r in scan_cache_dir().repos if r.repo_id == entry.id and r.repo_type == "model"]
            scan_cache_dir().delete_revisions(*[rev.commit_hash for r in repos for rev in r.revisions]).execute()
        elif entry.path.is_dir():
            shutil.rmtree(entry.path)
        else:
            entry.path.unlink()
        self.finder.refresh()
        self.say(f"deleted {entry.id} ({size_text(entry.disk_bytes)})")
        return f"Deleted {entry.id}."

    @staticmethod
    def _delete_gguf(entry: ModelEntry) -> None:
        """Remove a GGUF model's files: in the Hugging Face cache its snapshot links and their blobs (the
        whole repository when it holds nothing else of use), elsewhere the files; then its model folder."""
        doomed = {p.resolve() for p in entry.files}
        if entry.source == "Hugging Face cache":
            info = scan_cache_dir()
            repos = [r for r in info.repos if any(f.blob_path in doomed for rev in r.revisions for f in rev.files)]
            files = [f for r in repos for rev in r.revisions for f in rev.files]
            if not any(f.file_name.endswith((".gguf", ".safetensors", ".bin")) for f in files
                       if f.blob_path not in doomed):
                info.delete_revisions(*[rev.commit_hash for r in repos for rev in r.revisions]).execute()
            else:
                for f in files:
                    if f.blob_path in doomed:
                        f.file_path.unlink()
                for blob in doomed:
                    blob.unlink(missing_ok=True)
        else:
            for part in entry.files:
                part.unlink()
        if entry.path is not None and entry.path.is_relative_to(cache_dir() / "gguf"):
            shutil.rmtree(entry.path, ignore_errors=True)  # its config, tokenizer files and link; made again on use
