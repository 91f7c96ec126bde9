"""The speech models `--stt` and `--voice` name, as loaders for their first use: the ones that come with the app
(Whisper tiny.en, the en_US-joe-medium voice), a folder or file of the user's, or the hub's (downloaded then, with
the terminal's progress bar)."""

from __future__ import annotations

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


def whisper_folder(value: str) -> tuple[str, Callable[[], Path] | None]:
    """(the model's name, where its folder is, found or downloaded) for `--stt VALUE`; None: none to load."""
    if value == "none":
        return value, None
    if value == "auto":
        folder = transcribe.built_in_folder()
        return transcribe.BUILT_IN, (lambda: folder) if folder is not None else None
    path = Path(value).expanduser()
    if path.is_dir():
        return path.name, lambda: path
    repo = transcribe.HUB.get(value, value)
    if repo.count("/") != 1 or path.exists():
        raise UserError(f"--stt {value}: not a Whisper size ({', '.join(transcribe.HUB)}), a faster-whisper folder "
                        f"nor a hub id" + ("" if path.exists() else " (no such folder)"))

    def download() -> Path:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo, allow_patterns=WHISPER_FILES))
    return value, download


def voice_file(value: str) -> tuple[str, Callable[[], Path] | None]:
    """(the voice's name, where its .onnx file is, found or downloaded) for `--voice VALUE`; None: none to load."""
    if value == "none":
        return value, None
    if value == "auto":
        found = piper_voice.built_in_voice()
        return piper_voice.BUILT_IN, (lambda: found) if found is not None else None
    path = Path(value).expanduser()
    if path.suffix == ".onnx" and path.is_file():
        return path.stem, lambda: path
    named = PIPER_NAME.match(value)
    if named is None:
        raise UserError(f"--voice {value}: not a Piper voice file (.onnx)" + ("" if path.suffix != ".onnx" else
                        " (no such file)") + " nor a voice name like en_US-lessac-medium")
    where = f"{named['language']}/{named['language']}_{named['region']}/{named['name']}/{named['quality']}/{value}.onnx"

    def download() -> Path:
        from huggingface_hub import hf_hub_download

        hf_hub_download(PIPER_VOICES, f"{where}.json")
        return Path(hf_hub_download(PIPER_VOICES, where))
    return value, download


def speech_models(stt: str, voice: str, device: str, tell: Callable[[str], None]) -> Speech:
    """The app's `Speech`: `--stt` and `--voice` checked now, loaded on first use (`tell` hears how it goes)."""
    def loader(name: str, where: Callable[[], Path], make: Callable[[Path, str], object]) -> Callable[[], object]:
        def load():
            tell(f"loading {name}…")
            model = make(where(), name)
            tell(f"{name} ready ({'on the GPU' if device.startswith('cuda') else 'on the CPU'})")
            return model
        return load

    ears_name, ears = whisper_folder(stt)
    voice_name, speaker = voice_file(voice)
    return Speech(
        FirstUse(ears_name, loader(ears_name, ears, lambda f, n: Transcriber(f, n, device))) if ears else None,
        FirstUse(voice_name, loader(voice_name, speaker, lambda f, n: Voice(f, n, device))) if speaker else None)
