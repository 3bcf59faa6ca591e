"""A job file, read on rank 0 with bounded cost and checked line by line:
a bad line becomes an error record for its id, never the end of the run.

Input: one JSON object per line with ``id`` and ``prompt`` or ``messages``,
plus optional sampling parameters (max_tokens, temp, top_p, top_k, min_p,
seed) overriding the command line's. The file is a regular one of at most
``MAX_FILE_BYTES`` (a device such as ``/dev/zero`` never ends), every line
is read with bounded cost (``MAX_LINE_BYTES``, and ``json_input``'s limits)
and every field is checked before anything is broadcast. Ids are strings (an integer id is its
``str()``); the same id twice refuses the whole file before anything runs.
"""

import math
import os
import stat
from dataclasses import dataclass
from typing import Any, BinaryIO, Dict, Iterator, List, Optional, Tuple, Union

from mlxdist.inputs import json_input
from mlxdist.config import AUTO_WIDTH, GenerationParams
from mlxdist.errors import UserError, one_line
from mlxdist.inputs.json_input import MAX_DEPTH


SAMPLING_KEYS = ("max_tokens", "temp", "top_p", "top_k", "min_p", "seed", "num_draft_tokens", "prompt_lookup_ngram")
MAX_LINE_BYTES = 1 << 20  # a longer line (of the job file or --out) is refused unread
MAX_FILE_BYTES = 1 << 30  # a larger job file is refused: its entries are held before the run
SEED_LIMIT = 2**64  # seeds are 64-bit unsigned integers
INPUT_ERROR = 2  # exit status of a run refused for its input; the supervisor does not restart it
_SHOW = 60  # characters of a bad value quoted in a reason


@dataclass
class Job:
    """One valid input line."""

    id: str
    prompt: Optional[str]
    messages: Optional[list]
    sampling: Dict[str, Any]
    line: int = 0

    def sampling_key(self) -> Tuple:
        """What jobs decoded in one batch share."""
        return tuple(sorted(self.sampling.items()))


@dataclass
class BadLine:
    """An input line that cannot run: its id (``line:N`` where it has none)
    and the one-line reason."""

    id: str
    reason: str
    line: int

    def record(self) -> Dict[str, Any]:
        """Its error record in the output."""
        return error_record(self.id, self.reason, self.line)


Entry = Union[Job, BadLine]


def error_record(job_id: str, reason: str, line: int) -> Dict[str, Any]:
    """The output record of a job that cannot run."""
    return {"id": job_id, "error": reason, "line": line}


def placeholder_id(lineno: int) -> str:
    """The id of the record of a line with no usable id."""
    return f"line:{lineno}"


def show_value(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOW else text[: _SHOW - 3] + "..."


def parse_json_line(raw: bytes) -> Any:
    """One line (without its newline) as JSON, by the reader every input
    shares (``json_input.parse``: at most ``MAX_LINE_BYTES`` and
    ``MAX_DEPTH`` levels; an integer of more than ``MAX_INT_DIGITS`` digits
    or a non-finite number comes back as an ``Unreadable``, which a number
    field refuses by name). Raises ValueError worded to follow "line N"."""
    return json_input.parse(raw, MAX_LINE_BYTES, MAX_DEPTH)


def bounded_lines(f: BinaryIO) -> Iterator[Tuple[int, bytes, bool]]:
    """(line number, bytes without the newline, whether the newline was
    there) per line of ``f``; a line over ``MAX_LINE_BYTES`` comes back as its
    first ``MAX_LINE_BYTES + 1`` bytes, the rest read past in chunks, so no
    line is ever held whole."""
    lineno = 0
    while True:
        chunk = f.readline(MAX_LINE_BYTES + 1)
        if not chunk:
            return
        lineno += 1
        if chunk.endswith(b"\n"):
            yield lineno, chunk[:-1], True
            continue
        ended = False
        if len(chunk) > MAX_LINE_BYTES:  # over the cap: skip to its end
            while True:
                rest = f.readline(1 << 16)
                if not rest or rest.endswith(b"\n"):
                    ended = bool(rest)
                    break
        yield lineno, chunk, ended


def file_kind(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, in words."""
    kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def open_regular(path: str, what: str, flags: int = os.O_RDONLY, mode: str = "rb") -> BinaryIO:
    """``path`` opened with ``flags`` (without waiting: a FIFO would wait for
    a writer), or ``UserError`` naming ``what`` unless it is a regular file:
    a device (``/dev/zero``, ``/dev/urandom``, ``/dev/full``) never ends or
    never takes a write, a FIFO reads once."""
    try:
        fd = os.open(path, flags | os.O_NONBLOCK, 0o644)
    except OSError as e:
        raise UserError(f"cannot open {what} {path}: {e.strerror}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise UserError(f"{what} {path} is {file_kind(info.st_mode)}, not a regular file: give a file")
    os.set_blocking(fd, True)
    return os.fdopen(fd, mode)


# -- the job file -----------------------------------------------------------

def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_type(key: str, value: Any, lineno: int) -> None:
    where = f"line {lineno}: {key}"
    if key == "seed":
        if value is not None and not (is_integer(value) and 0 <= value < SEED_LIMIT):
            raise ValueError(f"{where} must be an integer from 0 to 2**64 - 1 (or null), got {show_value(value)}")
    elif key == "num_draft_tokens":
        if value != AUTO_WIDTH and not is_integer(value):
            raise ValueError(f"{where} must be an integer or auto, got {show_value(value)}")
    elif key in ("max_tokens", "top_k", "prompt_lookup_ngram"):
        if not is_integer(value):
            raise ValueError(f"{where} must be an integer, got {show_value(value)}")
    elif not is_number(value):
        raise ValueError(f"{where} must be a finite number, got {show_value(value)}")


def _check_messages(messages: Any, lineno: int) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"line {lineno}: messages must be a non-empty list of {{role, content}} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"line {lineno}: messages[{i}] is not an object")
        for key in ("role", "content"):
            if key not in m:
                raise ValueError(f"line {lineno}: messages[{i}] has no {key}")
            if not isinstance(m[key], str):
                raise ValueError(f"line {lineno}: messages[{i}].{key} must be a string, got {show_value(m[key])}")


def job_id(obj: Dict[str, Any], lineno: int) -> str:
    """The id of a parsed line: a JSON string as given, or an integer's
    ``str()``. Raises ValueError (null, another type, an empty string)."""
    if "id" not in obj:
        raise ValueError(f"line {lineno} has no id")
    value = obj["id"]
    if value is None:
        raise ValueError(f"line {lineno} has a null id")
    if is_integer(value):
        return str(value)
    if not isinstance(value, str):
        raise ValueError(f"line {lineno}: id must be a string or an integer, got {show_value(value)}")
    if not value:
        raise ValueError(f"line {lineno} has an empty id")
    return value


def parse_job(line: Union[str, bytes], lineno: int, defaults: Dict[str, Any]) -> Entry:
    """One input line as a ``Job``, or a ``BadLine`` with the reason: its
    JSON (bounded, ``parse_json_line``), id, prompt or messages and sampling
    values (types, then the ranges of ``GenerationParams``)."""
    raw = line.encode("utf-8", "surrogateescape") if isinstance(line, str) else line
    raw = raw.rstrip(b"\r\n")
    try:
        obj = parse_json_line(raw)
    except ValueError as e:
        return BadLine(placeholder_id(lineno), f"line {lineno} {e}", lineno)
    if not isinstance(obj, dict):
        return BadLine(placeholder_id(lineno), f"line {lineno} is not a JSON object", lineno)
    try:
        jid = job_id(obj, lineno)
    except ValueError as e:
        return BadLine(placeholder_id(lineno), str(e), lineno)
    try:
        prompt, messages = obj.get("prompt"), obj.get("messages")
        if (prompt is None) == (messages is None):
            raise ValueError(f"line {lineno}: needs exactly one of prompt or messages")
        if prompt is not None and not isinstance(prompt, str):
            raise ValueError(f"line {lineno}: prompt must be a string, got {show_value(prompt)}")
        if messages is not None:
            _check_messages(messages, lineno)
        sampling = {**defaults, **{k: obj[k] for k in SAMPLING_KEYS if k in obj}}
        for key in SAMPLING_KEYS:
            if key in sampling:
                _check_type(key, sampling[key], lineno)
        params = GenerationParams(**sampling)
        params.validate()  # the ranges, in the words the API and the command line use
    except UserError as e:
        return BadLine(jid, one_line(e), lineno)
    except ValueError as e:
        return BadLine(jid, str(e), lineno)
    except TypeError as e:  # a defaults key GenerationParams lacks: a caller's bug, reported per line
        return BadLine(jid, f"line {lineno}: {one_line(e)}", lineno)
    return Job(jid, prompt, messages, sampling, lineno)


def read_jobs(path: str, defaults: Dict[str, Any]) -> Iterator[Entry]:
    """A ``Job`` or a ``BadLine`` per non-blank line of the job file.
    Raises OSError where the file cannot be read, ``UserError`` where it is
    not a regular file or holds more than ``MAX_FILE_BYTES``."""
    with open_regular(path, "job file") as f:
        too_large = f"job file {path} holds more than {MAX_FILE_BYTES} bytes, the most a job file may: split it"
        if os.fstat(f.fileno()).st_size > MAX_FILE_BYTES:
            raise UserError(too_large)
        for lineno, raw, _ in bounded_lines(f):
            if f.tell() > MAX_FILE_BYTES:  # it grew while read
                raise UserError(too_large)
            if not raw.strip():
                continue
            yield parse_job(raw, lineno, defaults)


def check_unique(entries: List[Entry], path: str) -> None:
    """Refuse (``UserError``, one line) a job file in which two lines have
    the same id: an integer id is its ``str()``, so ``1`` and ``"1"`` are one
    id, and a line without a usable id holds ``line:N``."""
    lines: Dict[str, List[int]] = {}
    for entry in entries:
        lines.setdefault(entry.id, []).append(entry.line)
    repeated = [(i, n) for i, n in lines.items() if len(n) > 1]
    if not repeated:
        return
    shown = "; ".join(f"{show_value(i)} on lines {', '.join(map(str, n))}" for i, n in repeated[:5])
    more = f"; and {len(repeated) - 5} more" if len(repeated) > 5 else ""
    raise UserError(f"{path}: duplicate ids (ids are strings: 1 and \"1\" are one id): {shown}{more}; "
                    f"nothing was run")


def load_job_file(path: str, defaults: Dict[str, Any]) -> List[Entry]:
    """Every entry of the job file, checked for duplicate ids. Raises
    ``UserError`` (unreadable file, duplicates)."""
    try:
        entries = list(read_jobs(path, defaults))
    except OSError as e:
        raise UserError(f"cannot read job file {path}: {e.strerror}") from None
    check_unique(entries, path)
    return entries
