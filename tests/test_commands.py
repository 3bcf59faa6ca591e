"""The control messages' codec (runtime/control.py): every command rank 0
broadcasts round-trips typed, and anything else is one ProtocolError line."""

import json

import pytest

from mlxdist.config import (
    GenerateCommand, GenerationParams, LoadCommand, LoadOptions, PlaceCommand, ProbeCommand, ServeCommand,
    ShutdownCommand, StatsCommand,
)
from mlxdist.runtime import control
from mlxdist.runtime.control import ProtocolError

EVERY_COMMAND = [
    LoadCommand(LoadOptions("m", mode="p2p", placement={"version": 1, "layers": {}}, memory_budget_gb=2,
                            rank_memory_gb={"mac-a": 24.0, "mac-b": 16.5}, revision="v1")),
    LoadCommand(LoadOptions("m", rank_memory_gb=[8.0, 4.0], expert_capacity=3)),
    GenerateCommand([[1, 2, 3]], GenerationParams(max_tokens=4, temp=0.5, seed=7, num_draft_tokens=3),
                    verify_width="speculative: prompt lookup drafts 3 tokens a forward"),
    GenerateCommand([[1], [2, 3]], GenerationParams(max_tokens=[4, 5], num_draft_tokens="auto"), "collective",
                    batch=True),
    StatsCommand(),
    StatsCommand(reset=True, collect=False, routing=True),
    ProbeCommand("profile", {"tokens": 8, "layers": [0, 1], "note": None}),
    ServeCommand({"host": "127.0.0.1", "port": 8080, "log_level": "INFO"}),
    PlaceCommand({"version": 1, "layers": {"0": [0, 1]}}),
    ShutdownCommand(3),
]


@pytest.mark.parametrize("command", EVERY_COMMAND, ids=lambda c: type(c).__name__)
def test_every_command_round_trips_typed(command):
    decoded = control.decode(control.encode(command))
    assert decoded == command and type(decoded) is type(command)
    for name, value in vars(command).items():  # nested options arrive as their dataclass, not a dict
        assert type(getattr(decoded, name)) is type(value), name


def test_every_op_has_its_command():
    assert {type(c).op for c in EVERY_COMMAND} == set(control.OPS)


def _wire(op, args, version=control.PROTOCOL_VERSION):
    return json.dumps({"version": version, "op": op, "args": args}).encode()


_GOOD_GENERATE = json.loads(control.encode(EVERY_COMMAND[2]))["args"]


@pytest.mark.parametrize("data,message", [
    (_wire("shutdown", {"exit_code": 1}, version=4), "control protocol version 4, this rank speaks"),
    (_wire("shutdown", {"exit_code": 1}, version="5"), "control protocol version '5'"),
    (_wire("shutdown", {"exit_code": 1, "code": 2}), "unknown field shutdown.code"),
    (_wire("shutdown", {"exit_code": "1"}), "shutdown.exit_code is a string, not an integer"),
    (_wire("shutdown", {"exit_code": True}), "shutdown.exit_code is a boolean, not an integer"),
    (_wire("stats", {"collect": 1}), "stats.collect is a number, not a boolean or null"),
    (_wire("probe", {"args": {}}), "probe lacks its field name"),
    (_wire("load", {"options": {"model": "m", "pickle": True}}), "unknown field load.options.pickle"),
    (_wire("load", {"options": {"mode": "p2p"}}), "load.options lacks its field model"),
    (_wire("load", {"options": "m"}), "load.options is a string, not a JSON object"),
    (_wire("load", {"options": {"model": "m", "rank_memory_gb": ["8"]}}), "load.options.rank_memory_gb is a list"),
    (_wire("generate", {**_GOOD_GENERATE, "prompts": [[1, "2"]]}), "generate.prompts[0][1] is a string"),
    (_wire("generate", {**_GOOD_GENERATE, "prompts": [1, 2]}), "generate.prompts[0] is a number, not a list"),
    (_wire("generate", {**_GOOD_GENERATE, "sampling": {**_GOOD_GENERATE["sampling"], "temp": "hot"}}),
     "generate.sampling.temp is a string, not a number"),
    (_wire("generate", {**_GOOD_GENERATE, "sampling": {"top_n": 3}}), "unknown field generate.sampling.top_n"),
    (_wire("generate", {**_GOOD_GENERATE, "batch": None}), "generate.batch is null, not a boolean"),
    (b'{"version": 6, "op": "stats", "args": {}, "extra": 1}', "unknown key 'extra'"),
    (b'{"version": 6, "op": ["load"]}', "unknown command ['load']"),
    (b'{"version": 6, "op": "probe", "args": {"name": "p", "args": {"x": ' + b"[" * 100000 + b"]" * 100000 + b"}}}",
     "nested too deeply"),
])
def test_malformed_commands_are_one_protocol_error(data, message):
    with pytest.raises(ProtocolError) as refused:
        control.decode(data)
    line = str(refused.value)
    assert message in line and "\n" not in line, line


def test_rank_0_refuses_before_sending():
    class Explode(control.Command):
        op = "explode"

    with pytest.raises(ProtocolError, match="unknown command 'explode'"):
        control.encode(Explode())
    with pytest.raises(ProtocolError, match="probe cannot be sent as JSON"):
        control.encode(ProbeCommand("profile", {"x": object()}))


def test_load_options_are_public():
    import mlxdist

    assert mlxdist.LoadOptions is LoadOptions and "LoadOptions" in mlxdist.__all__
