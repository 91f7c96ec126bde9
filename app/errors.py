"""The one place where a `UserError` becomes what a person or an API client is told.

Pipelines raise `UserError` and never import Gradio. In the page (`shown_to_user`) a user's mistake
is a warning toast, one line in the server's console, and every component left as it was (no red
"Error" badges over the chat). Through the Gradio API (`raised_to_client`) it is the call's error
message. Anything else is a bug: Gradio shows it and keeps its traceback in the console.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable

import gradio as gr

from pipeline.errors import UserError


def _catching(fn: Callable, answer: Callable[[UserError], object]) -> Callable:
    """`fn` (a function or a generator function) giving `answer(error)` in place of a `UserError`."""
    if inspect.isgeneratorfunction(fn):
        @functools.wraps(fn)
        def generator(*args, **kwargs):
            try:
                yield from fn(*args, **kwargs)
            except UserError as e:
                yield answer(e)
        return generator

    @functools.wraps(fn)
    def function(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            return answer(e)
    return function


def _toast(error: UserError) -> object:
    gr.Warning(str(error))
    print(f"[studio] not done (a user's request): {error}", file=sys.stderr, flush=True)
    return gr.skip()  # one skip for every output: each stays as it was


def _raise(error: UserError) -> object:
    print(f"[studio] not done (a user's request): {error}", file=sys.stderr, flush=True)
    raise gr.Error(str(error), print_exception=False) from None


def shown_to_user(fn: Callable) -> Callable:
    """A page handler whose `UserError` is a toast, leaving its outputs as they were."""
    return _catching(fn, _toast)


def raised_to_client(fn: Callable) -> Callable:
    """A Gradio API endpoint (or a handler whose outputs are hidden) whose `UserError` is the call's
    error, with its message."""
    return _catching(fn, _raise)
