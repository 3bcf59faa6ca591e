"""Every error mlxdist reports, under one base class, and how they are
reported: one line on stderr; the traceback of an unexpected error (any
exception that is not an ``MlxdistError``) is kept in a per-rank file (and
printed too with ``MLXDIST_DEBUG=1``).

    MlxdistError                 reported as its message alone
      UserError                  the user's input: arguments, model, prompt, files
        ModelNotFound            no such folder or hub id
        CheckpointError          a checkpoint that cannot be read
        PlacementError           a placement that does not fit
        StepFailed               a shared step failed on some rank, raised on every rank alike
          LoadError              LOAD failed on some rank (the message names them)
        RequestError             an HTTP request the server refuses (a 4xx)
          RequestTimeout         its whole request did not arrive in time (408)
          HeadersTooLarge        its request line and headers passed their bound (431)
        BadVariable              an environment variable that does not read as its type
      ProtocolError              a control message this rank cannot read
      RoutingWeightsNotFound     a MoE block whose router weights dp cannot find
      RankLost                   a rank was lost while serving
      GenerationFailed           the server's generation loop failed under a request
      AnswerFailed               an agent API's answer the front cannot give (its HTTP status)
"""

import os
import sys
import tempfile
import traceback
from typing import List, Optional


class MlxdistError(Exception):
    """Base of every error mlxdist raises on purpose; its message is the report."""


class UserError(MlxdistError):
    """A problem with the user's input (arguments, model, prompt)."""


class ModelNotFound(UserError):
    pass


class NotInHubCache(ModelNotFound):
    """A hub id this host's hub cache does not hold (another rank may send it)."""


class CheckpointError(UserError, RuntimeError):
    pass


class PlacementError(UserError, ValueError):
    pass


class StepFailed(UserError):
    """A shared step (a load, a placement, a gathered command) failed on at
    least one rank: raised on every rank at the same agreement
    (``runtime/agreement.py``'s ``agree``), so none waits for another."""


class LoadError(StepFailed):
    """LOAD failed on at least one rank; the message names the ranks."""


class OutputError(UserError):
    """A record the ``--out`` file would not take: the run stops with this line."""


class RankStartError(MlxdistError, RuntimeError):
    """A start-up failure of this rank's own (its host, not the job's
    input): every rank that meets one says so itself."""


class RequestError(UserError, ValueError):
    """A request the server refuses: HTTP ``status`` (400), naming the field ``param``."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400):
        super().__init__(message)
        self.param = param
        self.status = status


class RequestTimeout(RequestError):
    """A request that did not arrive whole within its deadline (a 408)."""

    def __init__(self, message: str):
        super().__init__(message, None, 408)


class HeadersTooLarge(RequestError):
    """A request line and headers past their bound in bytes or lines (a 431)."""

    def __init__(self, message: str):
        super().__init__(message, None, 431)


class BadVariable(UserError, RuntimeError):
    """An environment variable that does not read as its type (one line, naming it)."""


class ProtocolError(MlxdistError, RuntimeError):
    pass


class RoutingWeightsNotFound(MlxdistError, ValueError):
    pass


class RankLost(MlxdistError, RuntimeError):
    pass


class GenerationFailed(MlxdistError, RuntimeError):
    """The server's generation loop failed while a request was in flight (its HTTP 500)."""


class Unavailable(MlxdistError, RuntimeError):
    """The rank job behind the front is not serving (starting, recovering,
    stopped) or was lost mid-answer: HTTP 503, try again after
    ``retry_after`` seconds."""

    status = 503

    def __init__(self, message: str, retry_after: int = 5):
        super().__init__(message)
        self.retry_after = max(1, int(retry_after))


class AnswerFailed(MlxdistError, RuntimeError):
    """An answer the front's agent APIs cannot give (``front/translate.py``):
    its request refused, or the rank server's refusal or failure; HTTP
    ``status``, and ``retry_after`` seconds where the rank server gave them."""

    def __init__(self, message: str, status: int, retry_after: Optional[int] = None):
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


def one_line(e: BaseException) -> str:
    """An exception as one line: an ``MlxdistError``'s message, else its
    type and first line."""
    text = str(e).splitlines()[0] if str(e) else ""
    if isinstance(e, MlxdistError):
        return text
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def failure_line(rank: int, error: BaseException) -> str:
    """``rank R: Type: first line``: how a rank that ends the job names itself and the cause."""
    text = one_line(error)
    return f"rank {rank}: {text if not isinstance(error, MlxdistError) else f'{type(error).__name__}: {text}'}"


def describe_errors(errors: List[Optional[str]]) -> str:
    """One line: the first error, naming the ranks that hit it where not all did."""
    first = next(e for e in errors if e)
    ranks = [r for r, e in enumerate(errors) if e == first]
    if len(ranks) == len(errors):
        return first
    return f"{first} (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"


def say_error(message: str) -> None:
    """``mlxdist: error: <message>`` on stderr in one write: print() writes
    the text and its newline apart on an unbuffered stream, and Open MPI's
    own output, or another rank's, could land between them."""
    os.write(sys.stderr.fileno(), f"mlxdist: error: {message}\n".encode())


def keep_traceback(rank: int) -> Optional[str]:
    """Write the exception being handled, with its traceback, to this rank's
    log file and return the file's path (None if it cannot be written).
    ``MLXDIST_DEBUG=1`` also prints it to stderr."""
    from mlxdist import envs  # here, not above: envs reports its errors with this module's classes

    text = traceback.format_exc()
    if envs.get("MLXDIST_DEBUG"):
        print(text, file=sys.stderr, flush=True)
    folder = envs.get("MLXDIST_LOG_DIR") or tempfile.gettempdir()
    path = os.path.join(folder, f"mlxdist-rank{rank}-{os.getpid()}.log")
    try:
        with open(path, "a") as f:
            f.write(text)
    except OSError:
        return None
    return path
