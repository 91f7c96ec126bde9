"""Voice in a real browser (headless Debian Chromium with its fake microphone playing a WAV file): the question
spoken into Chat's microphone lands in the message box; with "Read replies aloud" on, the reply plays in the
speaker's audio element while it streams; a reply's own "Read aloud" plays it again, with sound; in voice mode the
question is heard and sent with no click, again and again."""

import re

import httpx
import numpy as np
import pytest

from conftest import launched
from pipeline.speech.audio_files import resampled, wav_bytes
from test_browser import CHROMIUM, FLAGS, browser_page  # noqa: F401 - skips without chromium
from test_browser_documents import non_loopback_address
from test_speech import pytestmark as speech_installed
from studio.speech_models import speech_models

pytestmark = [pytest.mark.browser, speech_installed]
sync_api = pytest.importorskip("playwright.sync_api")
decode_audio = pytest.importorskip("faster_whisper.audio").decode_audio
expect = sync_api.expect
QUESTION = "What time does the museum open on Sunday?"
PLAYING = "() => { const a = document.querySelector('#chat-speaker-audio'); return a && !a.paused && a.currentTime > 0.5 }"


def spoken_question(path) -> None:
    """The question as a microphone would hear it: the built-in voice at 48 kHz, a second of silence around it."""
    speech = speech_models("auto", "auto", "cpu", lambda line: None)
    sound = resampled(np.concatenate(list(speech.speak(QUESTION))), speech.speaker().sample_rate, 48_000)
    silence = np.zeros(48_000, np.int16)
    path.write_bytes(wav_bytes(np.concatenate([silence, sound, silence, silence]), 48_000))


def test_speak_a_question_and_hear_the_reply(tmp_path):
    spoken_question(tmp_path / "question.wav")
    flags = [*FLAGS, "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
             f"--use-file-for-fake-audio-capture={tmp_path / 'question.wav'}", "--autoplay-policy=no-user-gesture-required"]
    with launched(tmp_path / "launch.log", tmp_path / "cache") as app, sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=flags)
        with browser_page(browser, app.url) as page:
            mic = page.locator("#chat-mic")
            mic.get_by_role("button", name="Record", exact=True).click()
            page.wait_for_timeout(5_000)  # the file plays into the microphone as it would be spoken
            mic.locator("button.stop-button").click()
            box = page.get_by_placeholder("Type a message, Enter to send")
            expect(box).to_have_value(re.compile("what time does the museum open on sunday", re.IGNORECASE), timeout=120_000)

            page.locator("#chat-aloud input").check()
            box.press("Enter")
            page.wait_for_function(PLAYING, timeout=120_000)
            first = page.locator("#chat-speaker-audio").get_attribute("src")
            assert re.fullmatch(r"/speech/reply/[\w-]{20,}", first), first

            page.locator("#chat-status").get_by_text("tok/s").wait_for()
            history = page.locator("#chat-history")
            history.get_by_role("button", name="Feedback").last.click()
            history.get_by_role("button", name="Read aloud").last.click()
            page.wait_for_function(f"() => document.querySelector('#chat-speaker-audio')?.getAttribute('src') "
                                   f"!== '{first}'", timeout=60_000)
            page.wait_for_function(PLAYING, timeout=120_000)
            page.screenshot(path=str(tmp_path / "voice.png"))
            again = page.locator("#chat-speaker-audio").get_attribute("src")
            sound = httpx.get(app.url.rstrip("/") + again, timeout=300).content  # what the element plays: speech

            # voice mode: the microphone listens by itself, a pause sends the question, the reply is read aloud,
            # and it listens again (the fake microphone says the question over and over)
            asked = history.get_by_text(re.compile("museum open on sunday", re.IGNORECASE))
            before = asked.count()
            page.locator("#chat-voice input").check()
            expect(page.locator("#chat-aloud input")).to_be_checked()
            page.wait_for_function(f"() => [...document.querySelectorAll('#chat-history *')].filter(e => "
                                   f"e.children.length === 0 && /museum open on sunday/i.test(e.textContent)).length "
                                   f">= {before + 2}", timeout=180_000)
            page.locator("#chat-voice input").uncheck()
        (tmp_path / "reply.mp3").write_bytes(sound)
        samples = decode_audio(str(tmp_path / "reply.mp3"))
        assert len(samples) > 16_000 and float(np.sqrt(np.mean(samples ** 2))) > 0.01


def test_a_microphone_the_page_cannot_have_is_explained_with_how_to_fix_it(tmp_path):
    """A microphone the browser blocked (its permission refused) and a page opened over plain http from another
    computer (browsers give such a page no microphone): each says so under the microphone, with what to do."""
    address = non_loopback_address()
    with launched(tmp_path / "launch.log", tmp_path / "cache", "--host", "0.0.0.0") as app, \
            sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                    args=[*FLAGS, "--use-fake-device-for-media-stream", "--deny-permission-prompts"])
        with browser_page(browser, app.url) as page:
            page.locator("#chat-mic").get_by_role("button", name="Record", exact=True).click()
            expect(page.locator("#chat-mic-help")).to_contain_text("The microphone is blocked for this page: click "
                                                                   "the icon left of the address bar")
        if address is not None:
            with browser_page(browser, app.url.replace("127.0.0.1", address)) as page:
                expect(page.locator("#chat-mic-help")).to_contain_text("on a phone, open the --share link")
        browser.close()
