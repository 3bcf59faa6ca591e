"""Errors reported to the user in one line; the traceback of an unexpected
one is kept in a per-rank file (and printed too with ``MLXDIST_DEBUG=1``)."""

import os
import sys
import tempfile
import traceback
from typing import Optional


class UserError(Exception):
    """A problem with the user's input (arguments, model, prompt)."""


def say_error(message: str) -> None:
    """``mlxdist: error: <message>`` on stderr in one write: print() writes
    the text and its newline apart on an unbuffered stream, and Open MPI's
    own output, or another rank's, could land between them."""
    os.write(sys.stderr.fileno(), f"mlxdist: error: {message}\n".encode())


def keep_traceback(rank: int) -> Optional[str]:
    """Write the exception being handled, with its traceback, to this rank's
    log file and return the file's path (None if it cannot be written).
    ``MLXDIST_DEBUG=1`` also prints it to stderr."""
    text = traceback.format_exc()
    if os.environ.get("MLXDIST_DEBUG") == "1":
        print(text, file=sys.stderr, flush=True)
    folder = os.environ.get("MLXDIST_LOG_DIR") or tempfile.gettempdir()
    path = os.path.join(folder, f"mlxdist-rank{rank}-{os.getpid()}.log")
    try:
        with open(path, "a") as f:
            f.write(text)
    except OSError:
        return None
    return path
