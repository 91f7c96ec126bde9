"""Speech as the files and streams clients ask for: WAV (the standard library's writer), raw PCM (16-bit
little-endian mono at 24 kHz, as OpenAI's API sends it), and MP3, Opus, AAC and FLAC through PyAV's ffmpeg (which
faster-whisper brings) where its build has the encoder.
"""

from __future__ import annotations

import io
import wave
from collections.abc import Iterable, Iterator

import numpy as np

from pipeline.errors import UserError

PCM_RATE = 24_000
CODECS = {"mp3": ("mp3", "libmp3lame", "audio/mpeg"), "opus": ("ogg", "libopus", "audio/ogg"),
          "aac": ("adts", "aac", "audio/aac"), "flac": ("flac", "flac", "audio/flac")}
MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", **{k: v[2] for k, v in CODECS.items()}}


def wav_bytes(samples: np.ndarray, rate: int) -> bytes:
    """int16 mono `samples` as a WAV file."""
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.asarray(samples, np.int16).tobytes())
    return out.getvalue()


def resampled(samples: np.ndarray, rate: int, to: int) -> np.ndarray:
    """int16 mono `samples` at `rate` → at `to` (ffmpeg's resampler)."""
    if rate == to:
        return np.asarray(samples, np.int16)
    import av

    resampler = av.AudioResampler(format="s16", layout="mono", rate=to)
    frame = av.AudioFrame.from_ndarray(np.asarray(samples, np.int16)[None], format="s16", layout="mono")
    frame.sample_rate = rate
    pieces = [f.to_ndarray()[0] for f in [*resampler.resample(frame), *resampler.resample(None)]]
    return np.concatenate(pieces) if pieces else np.zeros(0, np.int16)


def encoded(samples: np.ndarray, rate: int, fmt: str) -> bytes:
    """int16 mono `samples` at `rate` as a whole file of `fmt` (`MEDIA_TYPES` but PCM, which streams)."""
    if fmt == "wav":
        return wav_bytes(samples, rate)
    if fmt not in CODECS:
        raise UserError(f"response_format {fmt!r} is not one of wav, {', '.join(CODECS)}", param="response_format")
    import av

    container, codec, _ = CODECS[fmt]
    out = io.BytesIO()
    try:
        with av.open(out, "w", format=container) as file:
            stream = file.add_stream(codec, rate=48_000 if fmt == "opus" else rate)
            stream.layout = "mono"
            frame = av.AudioFrame.from_ndarray(np.asarray(samples, np.int16)[None], format="s16", layout="mono")
            frame.sample_rate = rate
            for packet in [*stream.encode(frame), *stream.encode(None)]:
                file.mux(packet)
    except (av.error.FFmpegError, ValueError) as e:
        raise UserError(f"response_format {fmt!r}: this install's ffmpeg cannot encode it ({e}); wav and pcm always "
                        f"work", param="response_format") from None
    return out.getvalue()


class _Collected(io.RawIOBase):
    """A file that keeps what is written until it is taken (an encoder's output, streamed as it comes)."""

    def __init__(self):
        self.parts: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        out, self.parts = b"".join(self.parts), []
        return out


def mp3_stream(pieces: Iterable[np.ndarray], rate: int) -> Iterator[bytes]:
    """int16 mono `pieces` at `rate` as one MP3 stream, each piece's frames given as soon as they are encoded (a
    browser's <audio> plays it as it arrives)."""
    import av

    sink = _Collected()
    with av.open(sink, "w", format="mp3") as file:
        stream = file.add_stream("libmp3lame", rate=rate)
        stream.layout = "mono"
        for piece in [*pieces, None]:
            if piece is not None:
                frame = av.AudioFrame.from_ndarray(np.asarray(piece, np.int16)[None], format="s16", layout="mono")
                frame.sample_rate = rate
            for packet in stream.encode(None if piece is None else frame):
                file.mux(packet)
            if data := sink.take():
                yield data
    if data := sink.take():
        yield data
