"""The one JSON reader every input shares (inputs/json_input.py): job-file lines,
request bodies, placement, routing and device files, each at bounded cost.
The inputs' own tests (test_jobs, test_hostile, test_placement) send the
same kinds of text through the whole program."""

import time

import pytest

from mlxdist.inputs import json_input
from mlxdist.cli.job_file import parse_json_line
from mlxdist.errors import PlacementError, RequestError
from mlxdist.values.placement import Placement
from mlxdist.serving.schema import RequestLimits, check_request


@pytest.mark.parametrize("raw,reason", [
    (b'{"a": 1', "is not JSON: Expecting ',' delimiter (column 8)"),
    (b"\xff{}", "is not valid UTF-8 (byte 1)"),
    (b"[" * 65 + b"]" * 65, "nests deeper than 64 levels"),
    (b'"' + b"x" * 2000 + b'"', "is longer than 1000 bytes"),
])
def test_refusals_say_why(raw, reason):
    with pytest.raises(ValueError) as e:
        json_input.parse(raw, 1000)
    assert str(e.value) == reason


def test_numbers_python_should_not_hold_come_back_unreadable():
    value = json_input.parse(b'{"a": [1, ' + b"9" * 5000 + b'], "b": NaN, "c": 1e400, "d": 2.5}', 1 << 20)
    assert str(value["a"][1]) == "an integer of 5000 digits"
    assert str(value["b"]) == "NaN, not a finite number"
    assert str(value["c"]) == "the number 1e400, out of range"
    assert value["d"] == 2.5 and value["a"][0] == 1
    assert json_input.first_unreadable(value) is not None
    assert json_input.first_unreadable({"a": [1, {"b": "NaN"}]}) is None


def test_the_cost_is_bounded_whatever_the_text():
    tic = time.perf_counter()
    for raw in (b"[" * 500_000 + b"]" * 500_000, b'{"a": ' + b"9" * 500_000 + b"}", b'"' + b"\\\\" * 200_000 + b'"'):
        try:
            json_input.parse(raw, 4 << 20)
        except ValueError:
            pass
    assert time.perf_counter() - tic < 5  # int("9" * 500_000) alone takes seconds; a recursive descent overflows


def test_every_input_reads_alike(tmp_path):
    """The same text refused by the job file, the server and a placement file, each in its own words."""
    deep = b'{"x": ' + b"[" * 100 + b"]" * 100 + b"}"
    with pytest.raises(ValueError, match="nests deeper than 64 levels"):
        parse_json_line(deep)
    with pytest.raises(RequestError, match="the request body nests deeper than 64 levels"):
        check_request(deep, RequestLimits(vocab_size=100))
    path = tmp_path / "placement.json"
    path.write_bytes(deep)
    with pytest.raises(PlacementError, match=f"placement file {path} nests deeper than 64 levels"):
        Placement.load(path)
    with pytest.raises(RequestError, match="the request body holds NaN, not a finite number"):
        check_request(b'{"prompt": "Hi", "temperature": NaN}', RequestLimits(vocab_size=100))
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (2 << 20))
    with pytest.raises(PlacementError, match="is larger than 1 MiB"):
        json_input.read_file(big, "routing", PlacementError, max_bytes=1 << 20)
