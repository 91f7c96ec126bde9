"""What a launch starts before its own imports (torch, gradio and the app take seconds): work that only
needs to know, from the command line alone, where the chat model will load."""

from __future__ import annotations

from plugins.compile_workers import start_early


def gpu_index(argv: list[str]) -> int | None:
    """The GPU the chat model would load on, as `--device` names it (auto: the first), or None for the CPU
    or a command that loads no model."""
    if {"--check", "-h", "--help"} & set(argv):
        return None
    device = next((a.split("=", 1)[1] for a in argv if a.startswith("--device=")),
                  next((b for a, b in zip(argv, argv[1:]) if a == "--device"), "auto"))
    index = device.removeprefix("cuda:")
    return None if device == "cpu" else int(index) if index.isdigit() else 0  # a wrong name: the app says so


def start(argv: list[str]) -> None:
    """The Triton compile workers of a first launch on a GPU (`start_early`), importing beside the app."""
    if (index := gpu_index(argv)) is not None:
        start_early(index)
