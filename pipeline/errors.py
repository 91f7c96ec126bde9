"""Errors a user can act on.

Anything raised as `UserError` carries a one-line message meant for a person (the UI shows it in a
toast, `launch.py` prints it as one line, the API answers 400 with it); anything else is a bug and
keeps its traceback.
"""


class UserError(ValueError):
    """Bad input, missing weights or a resource limit, told in words the user can act on. `param` names
    the request field at fault where there is one (the OpenAI API reports it)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
