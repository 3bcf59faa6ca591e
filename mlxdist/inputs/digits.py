"""Integers and durations read from text, one way everywhere: ASCII digits
only.

Python's ``int()`` and ``str.isdigit()`` take any Unicode digit: ``int("５")``
is 5, ``int("١")`` is 1, and ``"²".isdigit()`` is true while ``int("²")``
raises. A token id, a length, a port or a job-file integer is written in
ASCII digits (an optional leading ``-`` where negatives are allowed) or it
is refused, by the caller, naming the field.

    parse_int(text, field) -> int, or ValueError naming ``field``
    is_digits(text) -> whether it is ASCII digits (a key to check before int())
    parse_duration(text, field) -> a positive, finite number of seconds, or ValueError
    parse_number(text, field, low, high, above) -> a finite float in range, or ValueError
    arg_int / arg_duration / arg_number: the same as argparse types

``float()`` is as lax as ``int()`` (``float("５")`` is 5.0, ``float("1_0")``
10.0, ``float("nan")`` a number): every number read from text goes through
``parse_number``.
"""

import argparse
import math
import re
from typing import Callable, Optional, Union

MAX_DIGITS = 20  # a 64-bit unsigned integer; int() of a longer text costs the square of its length
_INT = re.compile(r"-?[0-9]+\Z")
_NUMBER = re.compile(r"(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?\Z")
MAX_NUMBER_CHARS = 64


def parse_int(text: str, field: str, signed: bool = False, max_digits: int = MAX_DIGITS) -> int:
    """``text`` as an integer of ASCII digits (a leading ``-`` only where
    ``signed``), at most ``max_digits`` long; else ValueError naming ``field``."""
    kind = "an integer" if signed else "a non-negative integer"
    if not isinstance(text, str) or not _INT.match(text) or (text[0] == "-" and not signed):
        raise ValueError(f"{field} must be {kind} in ASCII digits, not {_show(text)}")
    if len(text.lstrip("-")) > max_digits:
        raise ValueError(f"{field} must be {kind} of at most {max_digits} digits")
    return int(text)


def is_digits(text, max_digits: int = MAX_DIGITS) -> bool:
    """Whether ``text`` is a string of 1 to ``max_digits`` ASCII digits."""
    return isinstance(text, str) and 0 < len(text) <= max_digits and bool(_INT.match(text)) and text[0] != "-"


def parse_duration(text: str, field: str) -> float:
    """``text`` as a positive, finite number of seconds (ASCII: ``30``, ``0.5``,
    ``1e2``); else ValueError naming ``field``."""
    if not isinstance(text, str) or not _NUMBER.match(text) or not 0 < float(text) < math.inf:
        raise ValueError(f"{field} must be a positive, finite number of seconds, not {_show(text)}")
    return float(text)


def parse_number(text: str, field: str, low: Optional[float] = None, high: Optional[float] = None,
                 above: Optional[float] = None) -> float:
    """``text`` as a finite number written in ASCII (``2``, ``0.5``, ``1e2``;
    a leading ``-`` only where the range reaches below 0), at least ``low``,
    at most ``high`` and greater than ``above`` where given; else ValueError
    naming ``field`` and the range."""
    floor = low if low is not None else above
    body = text[1:] if isinstance(text, str) and text.startswith("-") and (floor is None or floor < 0) else text
    value = None
    if isinstance(body, str) and len(body) <= MAX_NUMBER_CHARS and _NUMBER.match(body):
        value = float(text)
    if value is None or not math.isfinite(value) or (low is not None and value < low) or (
            high is not None and value > high) or (above is not None and value <= above):
        raise ValueError(f"{field} must be {_range(low, high, above)} in ASCII digits, not {_show(text)}")
    return value


def parse_seconds_or_off(text: str, field: str, low: float) -> Optional[float]:
    """``text`` as seconds: ``off`` (or ``0``) is None, else a finite ASCII
    number of at least ``low``; ValueError naming ``field`` otherwise."""
    if text in ("off", "0"):
        return None
    try:
        return parse_number(text, field, low=low)
    except ValueError:
        raise ValueError(f"{field} must be a number of seconds of at least {low:g} in ASCII digits, "
                         f"or off, not {text!r:.40}") from None


def _range(low: Optional[float], high: Optional[float], above: Optional[float]) -> str:
    if low is not None and high is not None:
        return f"a number from {low:g} to {high:g}"
    if above is not None:
        return "a positive number" if above == 0 and high is None else (
            f"a number greater than {above:g}" + (f" and at most {high:g}" if high is not None else ""))
    if low is not None:
        return "a non-negative number" if low == 0 else f"a number of at least {low:g}"
    return f"a number of at most {high:g}" if high is not None else "a finite number"


def arg_int(low: Optional[int] = None) -> Callable[[str], int]:
    """An argparse type: an ASCII integer (of at least ``low`` where given:
    ``-1`` against a low of 1 is refused for being below it)."""

    def read(text: str) -> int:
        try:
            value = parse_int(text, "the value", signed=True)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if low is not None and value < low:
            raise argparse.ArgumentTypeError(f"the value must be at least {low}, not {value}")
        return value

    read.__name__ = "integer"  # argparse names the type in its messages
    return read


def arg_int_or(word: str, low: Optional[int] = None) -> Callable[[str], Union[int, str]]:
    """An argparse type: ``word`` itself, or an integer as ``arg_int(low)`` reads it."""
    integer = arg_int(low)

    def read(text: str) -> Union[int, str]:
        if text == word:
            return word
        try:
            return integer(text)
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"{e} (or {word})") from None

    read.__name__ = f"integer or {word}"
    return read


def arg_duration() -> Callable[[str], float]:
    """An argparse type: a positive, finite number of seconds."""

    def read(text: str) -> float:
        try:
            return parse_duration(text, "the value")
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    read.__name__ = "duration"
    return read


def arg_number(low: Optional[float] = None, high: Optional[float] = None,
               above: Optional[float] = None) -> Callable[[str], float]:
    """An argparse type: a finite number as ``parse_number`` reads it."""

    def read(text: str) -> float:
        try:
            return parse_number(text, "the value", low, high, above)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    read.__name__ = "number"
    return read


def _show(text) -> str:
    shown = repr(text)
    return shown if len(shown) <= 40 else shown[:37] + "..."
