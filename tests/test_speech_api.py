"""`/v1/audio/speech` and `/v1/audio/transcriptions` through the official `openai` client, on the real voice and
Whisper tiny.en: every response format both ways, OpenAI's model and voice names taken as ours, and each bad input
refused in words (garbage, a file that is no audio, silence, a foreign language for an English-only model, an
upload over the limit, a text too long to speak); PCM streams a long text sentence by sentence."""

from __future__ import annotations

import io
import json
import wave

import numpy as np
import openai
import pytest
import torch
from fastapi import FastAPI
from fastapi.testclient import TestClient

from app import openai_audio
from app.openai_api import build_router
from pipeline.service.studio import StudioService
from pipeline.service.tools import ToolHost
from pipeline.speech.audio_files import PCM_RATE, wav_bytes
from test_speech import SENTENCES, pytestmark  # noqa: F401 - skipped where the speech models are not installed
from studio.speech_models import speech_models

QUESTION = "What time does the museum open on Sunday?"


@pytest.fixture(scope="module")
def client():
    service = StudioService(ToolHost(torch.device("cpu"), None, lambda line: None),
                            speech=speech_models("auto", "auto", "cpu", lambda line: None))
    app = FastAPI()
    app.include_router(build_router(service, None, False))
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", max_retries=0,
                         http_client=TestClient(app))


def test_speech_then_its_transcription_in_every_format(client):
    spoken = client.audio.speech.create(model="tts-1", voice="alloy", input=QUESTION, response_format="wav").read()
    assert spoken[:4] == b"RIFF" and len(spoken) > 50_000
    said = client.audio.transcriptions.create(model="whisper-1", file=("question.wav", spoken))
    assert said.text.strip().lower().rstrip("?") == QUESTION.lower().rstrip("?")
    verbose = client.audio.transcriptions.create(model="whisper-1", file=("question.wav", spoken),
                                                 response_format="verbose_json", language="en", temperature=0.2,
                                                 prompt="museum")
    assert verbose.language == "en" and 1.5 < verbose.duration < 6 and verbose.segments[0].end > 1
    text = client.audio.transcriptions.create(model="whisper-1", file=("q.wav", spoken), response_format="text")
    assert text.strip() == said.text
    srt = client.audio.transcriptions.create(model="whisper-1", file=("q.wav", spoken), response_format="srt")
    assert srt.startswith("1\n00:00:00,") and " --> 00:00:0" in srt
    vtt = client.audio.transcriptions.create(model="whisper-1", file=("q.wav", spoken), response_format="vtt")
    assert vtt.startswith("WEBVTT\n\n00:00:00.")
    for fmt, magic in (("mp3", (b"ID3", b"\xff\xf3", b"\xff\xfb")), ("opus", (b"OggS",)), ("flac", (b"fLaC",)),
                       ("aac", (b"\xff\xf1", b"\xff\xf9"))):
        sound = client.audio.speech.create(model="tts-1-hd", voice="nova", input=QUESTION, response_format=fmt).read()
        assert sound.startswith(magic), (fmt, sound[:8])
        heard = client.audio.transcriptions.create(model="whisper-1", file=(f"q.{fmt}", sound)).text
        assert "museum" in heard.lower(), (fmt, heard)


def test_pcm_is_24_khz_and_speed_shortens_it(client):
    """PCM lasts as long as the WAV of the same text (the voice's own rate is 22,050 Hz: sent unconverted as 24 kHz
    it would be 8 % short). Piper draws each sound's length at random, so the text is long enough (8 sentences) that
    two readings differ by under 2 %."""
    text = " ".join(SENTENCES[:8])
    pcm = client.audio.speech.create(model="tts-1", voice="alloy", input=text, response_format="pcm").read()
    fast = client.audio.speech.create(model="tts-1", voice="alloy", input=text, response_format="pcm",
                                      speed=2.0).read()
    with wave.open(io.BytesIO(client.audio.speech.create(model="tts-1", voice="alloy", input=text,
                                                         response_format="wav").read())) as w:
        seconds = w.getnframes() / w.getframerate()
    assert abs(len(pcm) / 2 / PCM_RATE - seconds) < 0.04 * seconds, (len(pcm), seconds)  # the same sound at 24 kHz
    assert len(fast) < 0.7 * len(pcm)


def test_a_long_text_streams_sentence_by_sentence(client):
    """100,000 characters (about two hours of speech): the first sentence's sound arrives while the rest is still to
    be spoken, and leaving stops it."""
    text = " ".join(f"This is sentence number {i} of a very long text." for i in range(2100))[:100_000]
    with client.audio.speech.with_streaming_response.create(model="tts-1", voice="alloy", input=text,
                                                            response_format="pcm") as response:
        first = next(response.iter_bytes(4096))
    assert len(first) == 4096


def test_bad_requests_are_refused_in_words(client, monkeypatch):
    with pytest.raises(openai.BadRequestError, match="could not be read: it is not a recording"):
        client.audio.transcriptions.create(model="whisper-1", file=("q.wav", b"RIFF garbage" * 100))
    with pytest.raises(openai.BadRequestError, match="could not be read"):
        client.audio.transcriptions.create(model="whisper-1", file=("notes.mp3", "just text".encode() * 50))
    with pytest.raises(openai.BadRequestError, match="nothing was heard"):
        client.audio.transcriptions.create(model="whisper-1",
                                           file=("quiet.wav", wav_bytes(np.zeros(48_000, np.int16), 16_000)))
    with pytest.raises(openai.BadRequestError, match="English only"):
        client.audio.transcriptions.create(model="whisper-1", language="de",
                                           file=("q.wav", wav_bytes(np.zeros(48_000, np.int16), 16_000)))
    with pytest.raises(openai.NotFoundError, match="speech to text is whisper-tiny.en"):
        client.audio.transcriptions.create(model="whisper-large", file=("q.wav", b"x"))
    with pytest.raises(openai.BadRequestError, match="response_format must be one of json, text"):
        client.audio.transcriptions.create(model="whisper-1", file=("q.wav", b"x"), response_format="xml")
    monkeypatch.setattr(openai_audio, "MAX_UPLOAD_BYTES", 10_000)
    with pytest.raises(openai.APIStatusError, match="larger than 0 MiB") as refused:
        client.audio.transcriptions.create(model="whisper-1", file=("long.wav", b"\0" * 2_000_000))
    assert refused.value.status_code == 413
    monkeypatch.undo()
    with pytest.raises(openai.BadRequestError, match="at most 100,000 are spoken at once: split it"):
        client.audio.speech.create(model="tts-1", voice="alloy", input="a" * 100_001)
    with pytest.raises(openai.BadRequestError, match="speed must be between 0.25 and 4"):
        client.audio.speech.create(model="tts-1", voice="alloy", input="Hello.", speed=9)
    with pytest.raises(openai.BadRequestError, match="voice 'joanna' is not here"):
        client.audio.speech.create(model="tts-1", voice="joanna", input="Hello.")
    with pytest.raises(openai.BadRequestError, match="response_format must be one of wav, pcm"):
        client.audio.speech.create(model="tts-1", voice="alloy", input="Hello.", response_format="ogg")
    with pytest.raises(openai.BadRequestError, match="no text to speak"):
        client.audio.speech.create(model="tts-1", voice="alloy", input="  ")
    with pytest.raises(openai.BadRequestError) as empty:
        client.audio.speech.create(model="tts-1", voice="alloy", input="")
    assert json.loads(empty.value.response.text)["error"]["param"] == "input"  # OpenAI's error object
