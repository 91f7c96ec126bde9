"""Errors a user can act on.

Anything raised as `UserError` carries a one-line message meant for a person (the UI shows it in a
toast, `launch.py` prints it as one line); anything else is a bug and keeps its traceback.
"""


class UserError(ValueError):
    """Bad input, missing weights or a resource limit, told in words the user can act on."""
