"""Speech on this machine, ours against the libraries used directly, in one run:

- transcription real-time factor (seconds of compute per second of audio) of Whisper tiny.en through our
  `Transcriber` and through faster-whisper's own `WhisperModel.transcribe` (the same folder, compute type and
  voice-activity filter), on a minute of the built-in voice reading 20 sentences;
- speech real-time factor of the built-in Piper voice through our `Voice` and through piper's `synthesize_wav`;
- from the end of a spoken question to the first sound of the answer, through the app's own path (the question
  transcribed, the chat model's reply streamed, its first sentence spoken), with SmolLM2 on the CPU.

    python bench/speech.py [--device cpu|cuda] [--runs 3]

Prints a table; writes speech_<device>.json under $OUT (bench/results/ keeps them).
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import tempfile
import threading
import time
import wave
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))
from timing import report  # noqa: E402

from pipeline.speech.audio_files import wav_bytes  # noqa: E402
from pipeline.speech.piper_voice import built_in_voice  # noqa: E402
from pipeline.speech.transcribe import built_in_folder  # noqa: E402
from studio.speech_models import speech_models  # noqa: E402
from test_speech import SENTENCES  # noqa: E402

QUESTION = "What is the capital city of France?"


def best(fn, runs: int) -> float:
    """The median of `runs` timings of `fn()` after one warm-up, in seconds."""
    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    args = argparse.ArgumentParser()
    args.add_argument("--device", default="cpu")
    args.add_argument("--runs", type=int, default=3)
    opts = args.parse_args()
    import torch
    from faster_whisper import WhisperModel
    from piper import PiperVoice

    cuda = opts.device.startswith("cuda")
    res: dict = {"device": torch.cuda.get_device_name(0) if cuda else f"CPU ({__import__('os').cpu_count()} cores)"}
    speech = speech_models("auto", "auto", opts.device, lambda line: None)
    voice = speech.speaker()
    work = Path(tempfile.mkdtemp())
    story = " ".join(SENTENCES)
    sound = np.concatenate(list(voice.speak(story)))
    seconds = len(sound) / voice.sample_rate
    (work / "story.wav").write_bytes(wav_bytes(sound, voice.sample_rate))
    res["audio s"] = round(seconds, 1)

    ours = best(lambda: speech.transcribe(work / "story.wav"), opts.runs)
    direct = WhisperModel(str(built_in_folder()), device="cuda" if cuda else "cpu",
                          compute_type="float16" if cuda else "int8")
    theirs = best(lambda: " ".join(s.text for s in direct.transcribe(str(work / "story.wav"), language="en",
                                                                      vad_filter=True)[0]), opts.runs)
    res["transcribe RTF: ours"] = round(ours / seconds, 4)
    res["transcribe RTF: faster-whisper"] = round(theirs / seconds, 4)
    res["transcribe: ours / faster-whisper"] = round(ours / theirs, 3)

    ours_tts = best(lambda: sum(map(len, voice.speak(story))), opts.runs)
    piper = PiperVoice.load(str(built_in_voice()))

    def piper_wav() -> None:
        with wave.open(io.BytesIO(), "wb") as w:
            piper.synthesize_wav(story, w)
    theirs_tts = best(piper_wav, opts.runs)
    res["speech RTF: ours"] = round(ours_tts / seconds, 4)
    res["speech RTF: piper"] = round(theirs_tts / seconds, 4)
    res["speech: ours / piper"] = round(ours_tts / theirs_tts, 3)

    res.update(question_to_first_sound(speech, work, opts.device, opts.runs))
    report(f"speech_{'cuda' if cuda else 'cpu'}", res)


def question_to_first_sound(speech, work: Path, device: str, runs: int) -> dict:
    """The app's path from a recorded question to the first sound of its answer: transcription, the chat's reply
    streamed (SmolLM2, the model that comes with the app), its first sentence spoken."""
    from studio.compose import build
    from studio.config import parse_config
    from studio.plan import make_plan

    voice = speech.speaker()
    question = np.concatenate(list(voice.speak(QUESTION)))
    (work / "question.wav").write_bytes(wav_bytes(question, voice.sample_rate))
    config = parse_config(["--device", device, "--data-dir", str(work / "data")])
    service = build(config, make_plan(config), out=None)
    heard_s, first_s, replies = [], [], []
    try:
        for run in range(runs + 1):  # the first warms the model and the engines
            start = time.perf_counter()
            words = speech.transcribe(work / "question.wav").text
            heard = time.perf_counter()
            spoken = speech.spoken_reply()
            text = [""]

            def reply() -> None:  # as the page's handler streams it, on its own thread
                for update in service.send("bench", [], words, {"temperature": 0.0, "max_new_tokens": 120}):
                    text[0] += update.text
                    spoken.feed(text[0])
                spoken.feed(text[0], final=True)
            writing = threading.Thread(target=reply)
            writing.start()
            next(spoken.sound(wait_s=300))
            sounded = time.perf_counter()
            writing.join()
            if run:
                heard_s.append(heard - start)
                first_s.append(sounded - start)
                replies.append(text[0])
    finally:
        service.close()
    return {"question → words s": round(statistics.median(heard_s), 3),
            "question → first sound of the answer s": round(statistics.median(first_s), 3),
            "answer": replies[-1][:80]}


if __name__ == "__main__":
    main()
