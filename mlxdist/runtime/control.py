"""Control messages: what rank 0 tells the other ranks to do.

A command is plain JSON with a protocol version, broadcast from rank 0 with the
control plane's ``bcast_bytes`` (``runtime/plane.py``); nothing on the wire is ever unpickled. A rank that receives
something it cannot parse, a newer protocol, or an unknown op raises
``ProtocolError``, and the job stops cleanly.
"""

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Optional

from mlxdist.errors import ProtocolError
from mlxdist.runtime.world import World

PROTOCOL_VERSION = 4

LOAD = "load"
GENERATE = "generate"
STATS = "stats"
PROBE = "probe"
SHUTDOWN = "shutdown"
SERVE = "serve"
PLACE = "place"
OPS = (LOAD, GENERATE, STATS, PROBE, SHUTDOWN, SERVE, PLACE)


@dataclass
class Command:
    """One control message: ``op`` and its arguments.

    LOAD: the fields of ``config.LoadOptions``. GENERATE: prompts (lists of
    token ids), ``config.GenerationParams``, strategy (or None: auto's
    choice), batch (one batch response even for one prompt). STATS: reset, collect.
    PROBE: name and args of a registered probe (``executor.register_probe``).
    SERVE: the HTTP server's options (``serving/server.py``); every rank serves until rank 0 stops.
    PLACE: placement (a placement's JSON object): every rank holds its experts from now on.
    SHUTDOWN: exit_code.
    """

    op: str
    args: Dict[str, Any] = field(default_factory=dict)
    version: int = PROTOCOL_VERSION


def encode(command: Command) -> bytes:
    """The wire form: compact JSON."""
    return json.dumps(asdict(command), separators=(",", ":")).encode()


def decode(data: bytes) -> Command:
    """Parse and check one control message; raises ``ProtocolError``."""
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"control message is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("control message is not a JSON object")
    version = obj.get("version")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"control protocol version {version!r}, this rank speaks "
            f"{PROTOCOL_VERSION} (mixed mlxdist versions?)"
        )
    op = obj.get("op")
    if op not in OPS:
        raise ProtocolError(f"unknown command {op!r}")
    args = obj.get("args", {})
    if not isinstance(args, dict):
        raise ProtocolError(f"arguments of {op!r} are not a JSON object")
    return Command(op, args, version)


def broadcast(world: World, command: Optional[Command] = None) -> Command:
    """Rank 0 passes ``command``; every rank returns the decoded command.
    Rank 0 refuses an unknown command before it reaches anyone."""
    if world.is_root and command.op not in OPS:
        raise ProtocolError(f"unknown command {command.op!r}")
    return decode(world.control.bcast_bytes(encode(command) if world.is_root else None))
