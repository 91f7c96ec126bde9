"""The one place where a `UserError` becomes what Gradio shows a person (an error toast).

Handlers are wrapped with `shown_to_user`; pipelines raise `UserError` and never import Gradio.
Anything else is a bug and keeps its traceback in the terminal; a user error prints none there.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import gradio as gr

from pipeline.errors import UserError


def shown_to_user(fn: Callable) -> Callable:
    """`fn` (a function or a generator function) with `UserError` turned into `gr.Error`."""
    if inspect.isgeneratorfunction(fn):
        @functools.wraps(fn)
        def generator(*args, **kwargs):
            try:
                yield from fn(*args, **kwargs)
            except UserError as e:
                raise gr.Error(str(e), print_exception=False) from None
        return generator

    @functools.wraps(fn)
    def function(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            raise gr.Error(str(e), print_exception=False) from None
    return function
