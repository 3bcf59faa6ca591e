"""The front's command line: the rank server's own options
(``cli/serve.py``'s parser, checked the same way) and the front's, read
into ``FrontSettings``; what is not the front's own goes to the rank job as
it was typed (``rank_argv``).

    python -m mlxdist.serve --ranks N [--hostfile H] [--launcher mpirun|mlx.launch]
        [--allowed-hosts NAME,...] [--write-timeout S] [--retry-after S] --model M [--port P] [run/serve options]
"""

import argparse
import socket
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from mlxdist.cli.serve import build_parser, check_options
from mlxdist.inputs.digits import arg_duration, arg_int, arg_number
from mlxdist.errors import UserError
from mlxdist.front.job import JOB_OPTIONS, add_job_options
from mlxdist.front.store import DEFAULT_RESPONSES, MAX_RESPONSES
from mlxdist.front.upstream import DEFAULT_HOLD, DEFAULT_MAX_HELD

LAUNCHERS = ("mpirun", "mlx.launch")
DEFAULT_WRITE_TIMEOUT = 30.0
DEFAULT_RETRY_AFTER = 5
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARDS = ("0.0.0.0", "::", "")
# Options the front takes and the rank server does not get (it listens on loopback, behind the front).
FRONT_ONLY = ("--ranks", "--hostfile", "--launcher", "--allowed-hosts", "--write-timeout", "--retry-after",
              "--responses-store", "--recovery-hold", "--recovery-hold-max",
              "--host", "--port", "--api-key", "--api-key-file", "--allow-origin", "--max-connections", *JOB_OPTIONS)
# Connections the rank server keeps beyond the front's cap: the front's health probes.
RANK_CONNECTION_ROOM = 8
MAX_HOLD = 3600.0
MAX_HELD = 100_000


@dataclass(frozen=True)
class FrontSettings:
    """What the front serves with: its address (``port`` 0: a free one),
    the bearer token (None: none), the ``Host`` names it answers
    (``allowed_hosts``; ``"*"``: any), CORS origins, bounds on one
    connection (bytes, headers, seconds), seconds an answer may wait on a
    slow reader (``write_timeout``), the ``Retry-After`` of its 503s, and the
    rank job: ``ranks`` on ``hostfile``'s hosts started by ``launcher``
    with ``rank_argv`` (the rank server's options), and how it recovers
    (``min_ranks``, ``no_regrow``, ``regrow_every``: ``front/job.py``), and
    how long and how many requests lost before they said anything wait for
    the next job (``recovery_hold`` seconds, 0: none; ``recovery_hold_max``:
    ``front/upstream.py``)."""

    host: str
    port: int
    api_key: Optional[str]
    allowed_hosts: Tuple[str, ...]
    allow_origins: Tuple[str, ...]
    max_connections: int
    max_body: int
    max_header_bytes: int
    max_headers: int
    request_timeout: float
    idle_timeout: float
    write_timeout: float
    retry_after: int
    ranks: int
    hostfile: Optional[str]
    launcher: str
    rank_argv: List[str] = field(default_factory=list)
    min_ranks: int = 1
    no_regrow: bool = False
    regrow_every: float = 60.0
    responses_store: int = DEFAULT_RESPONSES
    recovery_hold: float = DEFAULT_HOLD
    recovery_hold_max: int = DEFAULT_MAX_HELD


def build_front_parser() -> argparse.ArgumentParser:
    """``cli/serve.py``'s parser with the front's options (no abbreviations:
    every option is either the front's or passed on as typed)."""
    p = build_parser()
    p.allow_abbrev = False
    p.description = ("An OpenAI-compatible HTTP front that starts the rank job itself and forwards to it "
                     "(--ranks), or the rank server under a launcher.")
    front = p.add_argument_group("the front (--ranks)")
    front.add_argument("--ranks", type=arg_int(1), required=True,
                       help="Ranks of the job the front starts and serves from (docs/serving.md).")
    front.add_argument("--hostfile", default=None, help="Open MPI hostfile of the job's hosts (host slots=N a line).")
    front.add_argument("--launcher", choices=LAUNCHERS, default="mpirun",
                       help="What starts the job: mpirun (launch/mpirun's settings) or mlx.launch.")
    front.add_argument("--allowed-hosts", default=None, metavar="NAME,...",
                       help="Host header names the front answers ('*': any); others get 421, so a web page "
                            "cannot reach it by DNS rebinding. Default: localhost, 127.0.0.1, ::1 and --host.")
    front.add_argument("--write-timeout", type=arg_duration(), default=DEFAULT_WRITE_TIMEOUT, metavar="SECONDS",
                       help="Seconds an answer may wait on a client that does not read it; then the connection "
                            "is cut (default %(default)s).")
    front.add_argument("--retry-after", type=arg_int(1), default=DEFAULT_RETRY_AFTER, metavar="SECONDS",
                       help="Retry-After of the 503 answered while the job is not serving (default %(default)s).")
    front.add_argument("--responses-store", type=arg_int(0), default=DEFAULT_RESPONSES, metavar="N",
                       help="Responses the front keeps for /v1/responses' previous_response_id, the least recently "
                            f"used dropped first (0: none; at most {MAX_RESPONSES}; default %(default)s).")
    front.add_argument("--recovery-hold", type=arg_number(low=0, high=MAX_HOLD), default=DEFAULT_HOLD,
                       metavar="SECONDS",
                       help="Seconds a request the job lost before it answered anything waits for the job started "
                            "on the ranks left, then is sent to it (0: answered 503 at once; default %(default)g).")
    front.add_argument("--recovery-hold-max", type=arg_int(0), default=DEFAULT_MAX_HELD, metavar="N",
                       help="Requests held so at most; past it, 503 with Retry-After (default %(default)s).")
    add_job_options(front)
    return p


def read_settings(argv: List[str]) -> FrontSettings:
    """The front's settings from its command line; ``SystemExit`` (2) for an
    option argparse refuses, ``UserError`` for one the checks refuse."""
    p = build_front_parser()
    args = p.parse_args(argv)
    problem = check_options(args)
    if problem:
        raise UserError(problem)
    if args.retry_after > 3600:
        raise UserError(f"--retry-after must be at most 3600 seconds, not {args.retry_after}")
    if args.recovery_hold_max > MAX_HELD:
        raise UserError(f"--recovery-hold-max must be at most {MAX_HELD}, not {args.recovery_hold_max}")
    if args.responses_store > MAX_RESPONSES:
        raise UserError(f"--responses-store must be at most {MAX_RESPONSES}, not {args.responses_store}")
    return FrontSettings(
        host=args.host, port=args.port, api_key=args.api_key, allowed_hosts=allowed_hosts(args.allowed_hosts, args.host),
        allow_origins=tuple(args.allow_origin), max_connections=args.max_connections, max_body=args.max_body_bytes,
        max_header_bytes=args.max_header_bytes, max_headers=args.max_headers, request_timeout=args.request_timeout,
        idle_timeout=args.idle_timeout, write_timeout=args.write_timeout, retry_after=args.retry_after,
        ranks=args.ranks, hostfile=args.hostfile, launcher=args.launcher,
        rank_argv=rank_argv(p, argv, args.max_connections), min_ranks=args.min_ranks, no_regrow=args.no_regrow,
        regrow_every=args.regrow_every, responses_store=args.responses_store, recovery_hold=args.recovery_hold,
        recovery_hold_max=args.recovery_hold_max)


def allowed_hosts(given: Optional[str], bound: str) -> Tuple[str, ...]:
    """The ``Host`` names answered: ``given`` (comma-separated), else the
    loopback names and the bound address (and this machine's name where
    bound to every address)."""
    if given is not None:
        names = [n.strip() for n in given.split(",")]
        if not names or any(not n or any(c.isspace() or c in "/@" for c in n) for n in names):
            raise UserError(f"--allowed-hosts {given!r}: give host names separated by commas ('*': any)")
        return tuple(_normal(n) for n in names)
    names = [*LOOPBACK_NAMES, bound]
    if bound in WILDCARDS:
        machine = socket.gethostname()
        names += [machine, f"{machine}.local"]
    return tuple(dict.fromkeys(_normal(n) for n in names if n not in WILDCARDS))


def host_name(header: str) -> str:
    """A ``Host`` header's name, without its port, in lower case."""
    header = header.strip()
    if header.startswith("["):  # [::1]:8080
        return _normal(header[1:header.find("]")] if "]" in header else header[1:])
    if header.count(":") == 1:
        header = header.split(":")[0]
    return _normal(header)


def _normal(name: str) -> str:
    return name.strip().strip("[]").rstrip(".").lower()


def rank_argv(p: argparse.ArgumentParser, argv: List[str], max_connections: int) -> List[str]:
    """The rank server's command line: ``argv`` without the front's own
    options (the job adds its address and token), with room for the
    front's connections."""
    options: Dict[str, argparse.Action] = {s: a for a in p._actions for s in a.option_strings}
    out, skip = [], False
    for i, word in enumerate(argv):
        if skip:
            skip = False
            continue
        name = word.split("=", 1)[0]
        if name in FRONT_ONLY and name in options:
            skip = "=" not in word and options[name].nargs != 0
            continue
        out.append(word)
    return [*out, "--max-connections", str(max_connections + RANK_CONNECTION_ROOM)]
