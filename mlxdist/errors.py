"""Errors reported to the user in one line, with no traceback."""


class UserError(Exception):
    """A problem with the user's input (arguments, model, prompt)."""
