"""`/speech/reply/{key}`: a reply read aloud, as an MP3 stream the page's <audio> plays while it arrives (the reply
is still being written: its sentences are spoken one after another). Each key is handed to one page
(`Speech.read_aloud`) and opens until that page has another reply read or presses Stop."""

from __future__ import annotations

from collections.abc import Iterator

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, Response, StreamingResponse

from pipeline.service.studio import StudioService
from pipeline.speech.audio_files import MEDIA_TYPES, mp3_stream
from pipeline.speech.spoken_reply import SpokenReply

WAIT_FOR_SOUND_S = 600.0  # for each piece of sound (a reply streaming slowly on a busy machine)


def mount_speech(app: FastAPI, service: StudioService) -> None:
    @app.get("/speech/reply/{key}")
    def reply(key: str) -> Response:
        spoken = service.speech.reading(key)
        if spoken is None:
            return PlainTextResponse("this reading ended (another reply was read, or Stop was pressed): press Read "
                                     "aloud on the reply", status_code=404)
        return StreamingResponse(_sound(spoken), media_type=MEDIA_TYPES["mp3"], headers={"Cache-Control": "no-store"})


def _sound(spoken: SpokenReply) -> Iterator[bytes]:
    try:
        yield from mp3_stream(spoken.sound(wait_s=WAIT_FOR_SOUND_S), spoken.sample_rate)
    except TimeoutError:  # a reply that stopped streaming without ending: what was said is played
        return
