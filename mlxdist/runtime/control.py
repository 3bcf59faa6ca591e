"""Control messages: what rank 0 tells the other ranks to do.

One dataclass per command (``config.py``: ``LoadCommand``, ``GenerateCommand``,
...), each a subclass of ``Command`` naming its ``op``. This module is the one
place they are encoded and checked: plain JSON with a protocol version,

    {"version": 6, "op": "generate", "args": {"prompts": [[1, 2]], "sampling": {...}, ...}}

broadcast from rank 0 with the control plane's ``bcast_bytes``
(``runtime/plane.py``); nothing on the wire is ever unpickled. Every field is
checked against its type hint as it is decoded (nested dataclasses, lists,
dicts, Optional, Union; an int is a float), so a command arrives typed. A
rank that receives something it cannot parse, a newer protocol, an unknown
op, an unknown or missing field or a value of the wrong type raises
``ProtocolError`` with one line, and the job stops cleanly; rank 0 checks its
own command the same way before any rank hears of it.
"""

import dataclasses
import functools
import json
import typing
from typing import Any, ClassVar, Dict, Optional, Type

from mlxdist.errors import ProtocolError
from mlxdist.runtime.world import World

PROTOCOL_VERSION = 6  # 6: LoadOptions.mode (was dispatch), GenerateCommand.mode (was strategy)

LOAD = "load"
GENERATE = "generate"
STATS = "stats"
PROBE = "probe"
SHUTDOWN = "shutdown"
SERVE = "serve"
PLACE = "place"
OPS = (LOAD, GENERATE, STATS, PROBE, SHUTDOWN, SERVE, PLACE)

_COMMANDS: Dict[str, Type["Command"]] = {}  # op -> its dataclass, filled as each is defined


class Command:
    """Base of the command dataclasses: ``op`` names the command; the
    dataclass's fields are its arguments."""

    op: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.op in OPS:
            _COMMANDS[cls.op] = cls


def encode(command: Command) -> bytes:
    """The wire form: compact JSON. Raises ``ProtocolError`` for an op that is
    not a command."""
    if _COMMANDS.get(command.op) is not type(command):
        raise ProtocolError(f"unknown command {command.op!r}")
    envelope = {"version": PROTOCOL_VERSION, "op": command.op, "args": dataclasses.asdict(command)}
    try:
        return json.dumps(envelope, separators=(",", ":")).encode()
    except (TypeError, ValueError) as e:
        raise ProtocolError(f"{command.op} cannot be sent as JSON: {e}") from None


def decode(data: bytes) -> Command:
    """Parse and check one control message into its command's dataclass;
    raises ``ProtocolError``."""
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"control message is not JSON: {e}") from None
    except RecursionError:
        raise ProtocolError("control message is nested too deeply") from None
    if not isinstance(obj, dict):
        raise ProtocolError("control message is not a JSON object")
    version = obj.get("version")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"control protocol version {version!r:.40}, this rank speaks "
            f"{PROTOCOL_VERSION} (mixed mlxdist versions?)"
        )
    unknown = sorted(set(obj) - {"version", "op", "args"})
    if unknown:
        raise ProtocolError(f"unknown key {unknown[0]!r:.40} in a control message")
    op = obj.get("op")
    if not isinstance(op, str) or op not in _COMMANDS:
        raise ProtocolError(f"unknown command {op!r:.40}")
    args = obj.get("args", {})
    if not isinstance(args, dict):
        raise ProtocolError(f"arguments of {op!r} are not a JSON object")
    return _dataclass(_COMMANDS[op], args, op)


def broadcast(world: World, command: Optional[Command] = None) -> Command:
    """Rank 0 passes ``command``; every rank returns the decoded command.
    Rank 0 refuses a command that would not decode before it reaches anyone."""
    data = None
    if world.is_root:
        data = encode(command)
        decode(data)
    return decode(world.control.bcast_bytes(data))


def _dataclass(cls: type, obj: Any, where: str) -> Any:
    """``obj`` (a JSON object) as an instance of the dataclass ``cls``, every
    field checked; ``where`` names it in an error."""
    if not isinstance(obj, dict):
        raise ProtocolError(f"{where} is {_kind(obj)}, not a JSON object")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(obj) - set(fields))
    if unknown:
        raise ProtocolError(f"unknown field {where}.{unknown[0]:.40}")
    hints = _hints(cls)
    values = {}
    for name, f in fields.items():
        if name in obj:
            values[name] = _value(obj[name], hints[name], f"{where}.{name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ProtocolError(f"{where} lacks its field {name}")
    return cls(**values)


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> Dict[str, Any]:
    return typing.get_type_hints(cls)


def _value(value: Any, hint: Any, where: str) -> Any:
    """``value`` checked against the type ``hint`` (dataclasses built)."""
    origin, params = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if dataclasses.is_dataclass(hint):
        return _dataclass(hint, value, where)
    if origin is typing.Union:
        for option in params:
            try:
                return _value(value, option, where)
            except ProtocolError:
                continue
        raise ProtocolError(f"{where} is {_kind(value)}, not {_name(hint)}")
    if origin in (list, dict):
        if not isinstance(value, origin):
            raise ProtocolError(f"{where} is {_kind(value)}, not {_name(hint)}")
        if origin is list:
            if not params or params[0] is Any or (params[0] in (int, str) and all(type(v) is params[0] for v in value)):
                return value  # token ids: one pass, not a call per token
            return [_value(v, params[0], f"{where}[{i}]") for i, v in enumerate(value)]
        return {k: _value(v, params[1], f"{where}.{k}") for k, v in value.items()} if params else value
    if hint is type(None):
        ok = value is None
    elif hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:  # bool, str, bare list and dict
        ok = isinstance(value, hint)
    if not ok:
        raise ProtocolError(f"{where} is {_kind(value)}, not {_name(hint)}")
    return value


def _kind(value: Any) -> str:
    """A JSON value's kind, for an error line."""
    names = {type(None): "null", bool: "a boolean", int: "a number", float: "a number", str: "a string",
             list: "a list", dict: "an object"}
    return names.get(type(value), type(value).__name__)


def _name(hint: Any) -> str:
    """A type hint as an error line names it."""
    if typing.get_origin(hint) is typing.Union:
        return " or ".join(_name(h) for h in typing.get_args(hint))
    names = {type(None): "null", bool: "a boolean", int: "an integer", float: "a number", str: "a string",
             list: "a list", dict: "an object"}
    origin = typing.get_origin(hint)
    if origin in (list, dict):
        return names[origin]
    return names.get(hint, getattr(hint, "__name__", str(hint)))
