"""One JSON reader for what users and clients hand mlxdist (job-file lines,
request bodies, placement and routing files), at bounded cost whatever the
text: a size limit checked before reading, strict UTF-8, a nesting limit
found by a scan without recursion, and numbers kept out of Python's own
limits (an integer of more than ``MAX_INT_DIGITS`` digits costs int() the
square of its length; NaN, Infinity and 1e400 are no numbers to compute
with). Such a number comes back as an ``Unreadable``: a field that must be a
number refuses it by name, and a reader that takes none refuses the whole
text (``first_unreadable``).
"""

import json
import math
import re
from pathlib import Path
from typing import Any, Optional, Union

from mlxdist.inputs.digits import parse_int
from mlxdist.errors import one_line

__all__ = ["MAX_DEPTH", "MAX_FILE_BYTES", "MAX_INT_DIGITS", "Unreadable", "first_unreadable", "nesting_depth",
           "parse", "read_file"]

MAX_DEPTH = 64  # deepest nesting of arrays and objects
MAX_INT_DIGITS = 100  # longest integer literal (a seed needs 20 digits)
MAX_FILE_BYTES = 64 << 20  # largest JSON file read whole (placements of a thousand-expert model are a few MB)
_SHOW = 60  # characters of a number quoted in a reason


class Unreadable:
    """A JSON number kept out of Python's numbers: an integer of more than
    ``MAX_INT_DIGITS`` digits, or one that is not finite."""

    def __init__(self, what: str):
        self.what = what

    def __repr__(self) -> str:
        return f"<{self.what}>"

    def __str__(self) -> str:
        return self.what


def _parse_int(text: str) -> Union[int, Unreadable]:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:  # counted before int(), whose cost grows with the square of the length
        return Unreadable(f"an integer of {digits} digits")
    return parse_int(text, "an integer", signed=True, max_digits=MAX_INT_DIGITS)


def _parse_float(text: str) -> Union[float, Unreadable]:
    value = float(text)
    return value if math.isfinite(value) else Unreadable(f"the number {text[:_SHOW]}, out of range")


def _parse_constant(name: str) -> Unreadable:
    return Unreadable(f"{name}, not a finite number")


_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_BRACKET = re.compile(r"[\[\]{}]")


def nesting_depth(text: str, limit: int = MAX_DEPTH) -> int:
    """The deepest nesting of arrays and objects in ``text``, outside
    strings, counted up to ``limit + 1`` (a cheap scan, no recursion)."""
    depth = deepest = 0
    for m in _BRACKET.finditer(_STRING.sub("", text)):
        depth += 1 if m.group() in "[{" else -1
        if depth > deepest:
            deepest = depth
            if deepest > limit:
                break
    return deepest


def parse(raw: bytes, max_bytes: int, max_depth: int = MAX_DEPTH) -> Any:
    """``raw`` as JSON: at most ``max_bytes``, strict UTF-8, at most
    ``max_depth`` levels; a number Python should not hold comes back as an
    ``Unreadable``. Raises ValueError with the reason, worded to follow what
    was read ("line 4 ...", "the request body ..."): "is longer than ...",
    "is not valid UTF-8 ...", "nests deeper than ...", "is not JSON: ..."."""
    if len(raw) > max_bytes:
        raise ValueError(f"is longer than {max_bytes} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"is not valid UTF-8 (byte {e.start + 1})") from None
    if nesting_depth(text, max_depth) > max_depth:
        raise ValueError(f"nests deeper than {max_depth} levels")
    try:
        return json.loads(text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant)
    except json.JSONDecodeError as e:
        raise ValueError(f"is not JSON: {e.msg} (line {e.lineno}, column {e.colno})"
                         if e.lineno > 1 else f"is not JSON: {e.msg} (column {e.colno})") from None
    except RecursionError:
        raise ValueError(f"nests deeper than {max_depth} levels") from None
    except ValueError as e:  # Python's own limits (int-from-str)
        raise ValueError(f"is not JSON: {one_line(e)}") from None


def first_unreadable(value: Any) -> Optional[Unreadable]:
    """The first ``Unreadable`` anywhere in a parsed ``value`` (None: every number is one)."""
    todo = [value]
    while todo:
        item = todo.pop()
        if isinstance(item, Unreadable):
            return item
        if isinstance(item, dict):
            todo.extend(item.values())
        elif isinstance(item, list):
            todo.extend(item)
    return None


def read_file(path: Union[str, Path], what: str, error: type, max_bytes: int = MAX_FILE_BYTES) -> Any:
    """The JSON file ``path`` (``what`` names it in messages), read whole
    only up to ``max_bytes`` and parsed by ``parse``; a number it cannot
    hold refuses the file. Raises ``error`` with one line."""
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise error(f"cannot read {what} file {path}: {e.strerror}") from None
    if len(data) > max_bytes:
        raise error(f"{what} file {path} is larger than {max_bytes >> 20} MiB")
    try:
        value = parse(data, max_bytes)
    except ValueError as e:
        raise error(f"{what} file {path} {e}") from None
    unreadable = first_unreadable(value)
    if unreadable is not None:
        raise error(f"{what} file {path} is not JSON mlxdist reads: it holds {unreadable}")
    return value
