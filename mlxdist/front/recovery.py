"""What the front does when the rank job loses a rank: which ranks were
lost, the job planned again on the ranks left (``cli/relaunch.py``, as
``python -m mlxdist.supervise`` plans it), the recovery's record, and when
to grow back to N.

    loss = read_loss(said, slots, seen_at)         # None: the job ended by itself
    plan = survivors_plan(slots, loss, serve_args)  # the slots and arguments of the next start
    ...                                             # the new job serves
    record = loss.record(serving_at)                # RankJob.last_recovery

Timing: ``detected_after_s`` is how long the rank was silent before the
front knew (the heartbeat's silence where the heartbeat named it; 0 where
the launcher reported its process's end as it happened);
``serving_again_after_s`` runs from the rank's last sign of life to the
restarted job's serving line.

Growing back: the lost hosts are asked whether they answer (a host of this
machine always does; another through the launcher: ``mpirun -np 1 --host H
true``, or ``ssh H true`` for ``mlx.launch``), at most once every
``regrow_every`` seconds, and only while no request is live.
"""

import json
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

from mlxdist.cli.relaunch import (
    RankSlot, heartbeat_losses, is_local, lost_ranks, mpirun_command, mpirun_env, open_mpi_prefix, replanned_args,
)
from mlxdist.errors import UserError
from mlxdist.runtime.launcher import own_session

PROBE_SECONDS = 20.0  # a host that has not run `true` by then does not answer


@dataclass
class Loss:
    """Ranks lost from one start of the job."""

    ranks: List[int]
    hosts: List[str]
    seen_at: float  # time.time() when the front first read a sign of it
    silent_s: float  # how long the rank was silent before that (0: its end was reported at once)

    def record(self, serving_at: float) -> Dict[str, Any]:
        """``RankJob.last_recovery``: the lost rank(s) and host(s), and the
        seconds from its last sign of life to detection and to serving again."""
        lost_at = self.seen_at - self.silent_s
        return {"lost_rank": self.ranks[0] if len(self.ranks) == 1 else self.ranks,
                "host": self.hosts[0] if len(set(self.hosts)) == 1 else self.hosts,
                "detected_after_s": round(self.silent_s, 3),
                "serving_again_after_s": round(serving_at - lost_at, 3),
                "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.seen_at))}


def read_loss(said: str, slots: List[RankSlot], seen_at: float) -> Optional[Loss]:
    """The ranks lost, from what the job said (``relaunch.lost_ranks``:
    the launcher's reports, the heartbeat's lines, the survivors'), or None
    where the job ended by itself."""
    ranks = lost_ranks(said, slots)
    if not ranks:
        return None
    silences = heartbeat_losses(said)  # {rank: (its host as the rank named it, seconds)}
    silent = max((silences[r][1] for r in ranks if r in silences), default=0.0)
    # the slot's name (the hostfile's, as /health's hosts), whatever the fault: the heartbeat's
    # line names a host by its own hostname, the launcher by the hostfile's
    return Loss(ranks, [slots[r].host for r in ranks], seen_at, silent)


@dataclass
class Plan:
    """One start of the rank job: its ranks and the serve arguments for them."""

    slots: List[RankSlot]
    serve_args: List[str]
    changed: str = ""  # what was planned again, in words


def survivors_plan(plan: Plan, loss: Loss, min_ranks: int, routing: Optional[str], scratch: str) -> Plan:
    """``plan`` without the lost ranks: budgets and placement for the ranks
    left as ``supervise`` plans them (``relaunch.replanned_args``; a rebuilt
    placement is written under ``scratch``). ``UserError`` where fewer than
    ``min_ranks`` would remain or the plan cannot be made."""
    survivors = [s for r, s in enumerate(plan.slots) if r not in loss.ranks]
    here = next((i for i, s in enumerate(survivors) if runs_here(s.host)), None)
    if survivors and here is None:
        raise UserError("no rank is left on this machine, where rank 0 must run (the front reaches its server on "
                        "loopback)")
    if here:  # rank 0 was lost: another rank of this machine takes its place (mpirun fills --host in order)
        survivors.insert(0, survivors.pop(here))
    if len(survivors) < min_ranks:
        raise UserError(f"only {len(survivors)} rank{'s' if len(survivors) != 1 else ''} would remain "
                        f"(--min-ranks {min_ranks})")
    try:
        args, changed = replanned_args(plan.serve_args, survivors, routing, str(Path(scratch) / "front"))
    except OSError as e:
        raise UserError(f"cannot plan the job again for {len(survivors)} ranks: {e}") from None
    return Plan(survivors, args, changed)


def runs_here(host: str) -> bool:
    """Whether a rank on ``host`` runs on this machine (``localhost``, or this machine's name)."""
    if is_local(host):
        return True
    name = socket.gethostname().lower()
    return host.lower() in (name, name.split(".")[0], name.split(".")[0] + ".local")


def launch_command(launcher: str, program: str, plan: Plan, hostfile: Optional[str], scratch: str,
                   module_args: List[str]) -> List[str]:
    """The command that starts ``python -m mlxdist.serve MODULE_ARGS`` on
    ``plan.slots``: mpirun as ``launch/mpirun`` runs it (``relaunch.
    mpirun_command``), or ``mlx.launch`` (its JSON hostfile cut to the
    slots' hosts, written under ``scratch``)."""
    if launcher == "mpirun":
        return mpirun_command(program, plan.slots, hostfile is not None, module_args, "mlxdist.serve")
    cmd = [program, "--backend", "ring"]
    if hostfile is None:
        cmd += ["-n", str(len(plan.slots))]
    else:
        cmd += ["--hostfile", _mlx_hostfile(hostfile, plan.slots, scratch)]
    return [*cmd, "--", sys.executable, "-m", "mlxdist.serve", *module_args]


def mlx_launch_slots(hostfile: str) -> List[RankSlot]:
    """One rank per host of an ``mlx.launch`` JSON hostfile (a list of
    hosts, or an object with ``hosts``), named by its ``ssh``."""
    try:
        data = json.loads(Path(hostfile).read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"--hostfile {hostfile}: not a JSON hostfile mlx.launch reads: {e}") from None
    hosts = data.get("hosts") if isinstance(data, dict) else data
    if not isinstance(hosts, list) or not hosts or not all(isinstance(h, dict) and isinstance(h.get("ssh"), str)
                                                          for h in hosts):
        raise UserError(f"--hostfile {hostfile}: expected a list of hosts each with \"ssh\"")
    return [RankSlot(h["ssh"]) for h in hosts]


def _mlx_hostfile(hostfile: str, slots: List[RankSlot], scratch: str) -> str:
    data = json.loads(Path(hostfile).read_text())
    hosts = data.get("hosts") if isinstance(data, dict) else data
    left, kept = [s.host for s in slots], []
    for host in hosts:
        if host["ssh"] in left:
            left.remove(host["ssh"])
            kept.append(host)
    if len(kept) == len(hosts):
        return hostfile
    cut = {**data, "hosts": kept} if isinstance(data, dict) else kept
    with tempfile.NamedTemporaryFile("w", suffix=".json", dir=scratch, delete=False) as f:
        json.dump(cut, f)
    return f.name


def host_answers(host: str, launcher: str, program: str) -> bool:
    """Whether ``host`` runs a command started the way the job is started
    (this machine always does)."""
    if is_local(host):
        return True
    if launcher == "mpirun":
        prefix = open_mpi_prefix(program)
        cmd = [program, "-np", "1", *(["--prefix", prefix] if prefix else []), "--host", f"{host}:1", "true"]
    else:
        cmd = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={int(PROBE_SECONDS)}", host, "true"]
    try:
        with own_session(mpirun_env()) as env:  # a probe cut short is killed: its session is ours to remove
            return subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  env=env, timeout=PROBE_SECONDS).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False
