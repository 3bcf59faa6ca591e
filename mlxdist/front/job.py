"""The rank job behind the front, started, watched and started again.

    job = RankJob(JobSpec(ranks=3, serve_args=["--model", M]))
    job.start()
    await job.wait_serving(600)      # True once the rank server listens
    job.base_url                     # "http://127.0.0.1:PORT"; None while not serving
    with job.request():              # around each forwarded request: growing back waits for none live
        ...
    await job.stop()                 # (job.stop_blocking() outside an event loop)

The job is ``mpirun -np N python -m mlxdist.serve --host 127.0.0.1 --port 0
--heartbeat S <serve args>`` (with ``launch/mpirun``'s settings; or
``mlx.launch``), its rank server's bearer token a secret of the front's
(``api_key``, given through the environment). Its standard error is passed
on line by line and read: the serving line gives the port; a heartbeat line
or the launcher's report of a rank's end means a rank is lost.

    states:  starting -> ok (N ranks) | degraded (fewer)
             ok | degraded -> recovering (a rank lost; growing back) -> ok | degraded
             any -> stopped (stop(); fewer than min_ranks left; a job that ended by itself)

On a loss the job is ended (its launcher, then its session, within
``END_GRACE`` seconds), planned again on the ranks left and started again
(``recovery.py``). While it is ``degraded``, it grows back to N when the lost
hosts answer, at most once every ``regrow_every`` seconds, between requests.
Each start keeps Open MPI's session in a folder of its own (``relaunch.Launch``).
"""

import argparse
import asyncio
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

from mlxdist.cli.relaunch import (
    END_GRACE, Launch, check_mpirun, find_mpirun, mpirun_env, option, rank_slots, with_option,
)
from mlxdist.errors import UserError
from mlxdist.front.recovery import (
    Loss, Plan, host_answers, launch_command, mlx_launch_slots, read_loss, survivors_plan,
)
from mlxdist.inputs.digits import arg_duration, arg_int
from mlxdist.runtime.heartbeat import DEFAULT_HEARTBEAT, default_heartbeat, parse_heartbeat

SERVING = re.compile(r"mlxdist: serving .* on http://\S+:(\d+) \(")
STOP_GRACE = 30.0  # seconds a clean stop (SIGINT to rank 0) may take
OWN_OPTIONS = ("--host", "--port", "--api-key", "--api-key-file")  # the job's are set here
DEFAULT_REGROW_EVERY = 60.0
# The front's options about its job (the rank server does not take them).
JOB_OPTIONS = ("--min-ranks", "--no-regrow", "--regrow-every")


def add_job_options(group: "argparse._ArgumentGroup") -> None:
    """The front's options about recovery (``JOB_OPTIONS``), for its parser."""
    group.add_argument("--min-ranks", type=arg_int(1), default=1,
                       help="Serve on no fewer ranks than this after losing some; below it the front stops "
                            "serving (default %(default)s).")
    group.add_argument("--no-regrow", action="store_true",
                       help="Stay on the ranks left after a loss; default: grow back to --ranks when the lost "
                            "hosts answer, between requests.")
    group.add_argument("--regrow-every", type=arg_duration(), default=DEFAULT_REGROW_EVERY, metavar="SECONDS",
                       help="Seconds between two tries to grow back (default %(default)s).")


@dataclass
class JobSpec:
    """What the front starts: ``ranks`` of ``python -m mlxdist.serve
    SERVE_ARGS`` (without the options in ``OWN_OPTIONS``), on ``hostfile``'s
    hosts (an Open MPI hostfile; a JSON one for ``mlx.launch``) or this
    machine; ``program``: the launcher's path (default: found as
    ``launch/mpirun`` finds mpirun; ``mlx.launch`` beside this Python)."""

    ranks: int
    serve_args: List[str]
    hostfile: Optional[str] = None
    launcher: str = "mpirun"
    heartbeat: float = DEFAULT_HEARTBEAT
    min_ranks: int = 1
    regrow: bool = True
    regrow_every: float = 60.0
    program: Optional[str] = None
    env: Dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_settings(cls, settings: Any) -> "JobSpec":
        """The job of the front's settings: ``ranks``, ``rank_argv``,
        ``hostfile``, ``launcher``, and where it has them ``min_ranks``,
        ``no_regrow``, ``regrow_every`` (``add_job_options``); the heartbeat
        is ``rank_argv``'s ``--heartbeat`` where given."""
        args = list(settings.rank_argv)
        for name in JOB_OPTIONS:
            args = with_option(args, name, None) if name != "--no-regrow" else [a for a in args if a != name]
        given = option(args, "--heartbeat")
        try:
            heartbeat = parse_heartbeat(given) if given is not None else default_heartbeat()
        except ValueError as e:
            raise UserError(str(e)) from None
        if heartbeat is None:
            raise UserError("the front needs the heartbeat to notice a lost rank: not --heartbeat off "
                            "(nor MLXDIST_HEARTBEAT=off)")
        return cls(settings.ranks, with_option(args, "--heartbeat", None), getattr(settings, "hostfile", None),
                   getattr(settings, "launcher", "mpirun"), heartbeat, getattr(settings, "min_ranks", 1),
                   not getattr(settings, "no_regrow", False),
                   getattr(settings, "regrow_every", DEFAULT_REGROW_EVERY))


class RankJob:
    """The rank job the front forwards to (see the module's docstring)."""

    def __init__(self, spec: JobSpec):
        if spec.launcher not in ("mpirun", "mlx.launch"):
            raise UserError(f"--launcher must be mpirun or mlx.launch, not {spec.launcher!r:.40}")
        if not 1 <= spec.min_ranks <= spec.ranks:
            raise UserError(f"--min-ranks must be from 1 to --ranks ({spec.ranks}), not {spec.min_ranks}")
        self.spec = spec
        self.api_key = secrets.token_urlsafe(24)
        self.state = "stopped"
        self.base_url: Optional[str] = None
        self.last_recovery: Optional[Dict[str, Any]] = None
        self.recoveries = 0
        self.regrown_at: Optional[str] = None
        self.error: Optional[str] = None  # why the job stopped by itself
        self._full: Optional[Plan] = None
        self._plan: Optional[Plan] = None
        self._launch: Optional[Launch] = None
        self._live = 0  # requests being answered
        self._regrow_off = False  # set when growing back failed by itself
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._scratch = tempfile.mkdtemp(prefix="mlxdist-front-")
        self._program = self._find_program()

    def _find_program(self) -> str:
        if self.spec.program:
            return check_mpirun(self.spec.program)
        if self.spec.launcher == "mpirun":
            return find_mpirun()
        beside = Path(sys.executable).parent / "mlx.launch"
        found = str(beside) if beside.exists() else shutil.which("mlx.launch")
        if found is None:
            raise UserError("cannot find mlx.launch beside this Python or on PATH (pip install mlx)")
        return found

    # -- what the front reads --------------------------------------------------------------

    @property
    def ranks(self) -> int:
        """Ranks of the job being run (or started)."""
        return len(self._plan.slots) if self._plan else 0

    @property
    def launcher_pid(self) -> Optional[int]:
        """The process id of the running start's launcher (its session holds every local rank)."""
        launch = self._launch
        return launch.proc.pid if launch is not None and launch.proc.poll() is None else None

    @property
    def hosts(self) -> List[str]:
        """Each rank's host, in rank order."""
        return [s.host for s in self._plan.slots] if self._plan else []

    async def wait_serving(self, timeout: float) -> bool:
        """Wait until the job serves (True), stops, or ``timeout`` seconds pass (False)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.state in ("ok", "degraded"):
                return True
            if self.state == "stopped":
                return False
            await asyncio.sleep(0.05)
        return self.state in ("ok", "degraded")

    @contextlib.contextmanager
    def request(self) -> Iterator[None]:
        """Around a request the front forwards: the job grows back only while none is live."""
        with self._lock:
            self._live += 1
        try:
            yield
        finally:
            with self._lock:
                self._live -= 1

    # -- starting and stopping -------------------------------------------------------------

    def start(self) -> None:
        """Plan the ranks and start the job; it is watched from a thread of its own.
        ``UserError`` for a hostfile or budgets that cannot be planned."""
        spec = self.spec
        args = list(spec.serve_args)
        for name in OWN_OPTIONS:
            args = with_option(args, name, None)
        if spec.launcher == "mlx.launch" and spec.hostfile:
            slots = mlx_launch_slots(spec.hostfile)
            if len(slots) != spec.ranks:
                raise UserError(f"--hostfile {spec.hostfile} has {len(slots)} hosts for --ranks {spec.ranks}")
        else:
            slots = rank_slots(spec.ranks, spec.hostfile, option(args, "--rank-memory"))
        self._full = self._plan = Plan(slots, args)
        self.state = "starting"
        self._thread = threading.Thread(target=self._watch, name="mlxdist-front-watch", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """End the job (``stop_blocking`` in a thread of its own)."""
        await asyncio.get_running_loop().run_in_executor(None, self.stop_blocking)

    def stop_blocking(self) -> None:
        """End the job: SIGINT to rank 0 (the server stops every rank), else
        the launcher's session killed after ``STOP_GRACE`` seconds."""
        self._stopping.set()
        launch = self._launch
        self._set("stopped", None)
        if launch is not None and launch.proc.poll() is None:
            pid = self._rank0_pid(launch)
            if pid is not None:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGINT)
            else:
                with contextlib.suppress(OSError):
                    launch.proc.send_signal(signal.SIGTERM)
            launch.end(STOP_GRACE if pid is not None else END_GRACE)
        if self._thread is not None:
            self._thread.join(STOP_GRACE)
        shutil.rmtree(self._scratch, ignore_errors=True)

    def _rank0_pid(self, launch: Launch) -> Optional[int]:
        if launch.ready is None:
            return None
        req = urllib.request.Request(f"http://127.0.0.1:{launch.ready.group(1)}/health",
                                     headers={"Authorization": f"Bearer {self.api_key}"})
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                pid = json.loads(r.read()).get("pid")
        except (OSError, ValueError):
            return None
        return pid if isinstance(pid, int) and pid > 0 else None

    # -- the watching thread ---------------------------------------------------------------

    def _start(self, plan: Plan) -> Launch:
        module_args = [*plan.serve_args, "--host", "127.0.0.1", "--port", "0", "--heartbeat", f"{self.spec.heartbeat:g}"]
        cmd = launch_command(self.spec.launcher, self._program, plan, self.spec.hostfile, self._scratch, module_args)
        env = {**mpirun_env(), **self.spec.env, "MLXDIST_API_KEY": self.api_key, "PYTHONUNBUFFERED": "1"}
        self._plan = plan
        _say(f"starting {len(plan.slots)} rank{'s' if len(plan.slots) > 1 else ''}{plan.changed}")
        return Launch(cmd, env, _echo, ready=SERVING)

    def _watch(self) -> None:
        plan = self._plan
        loss: Optional[Loss] = None
        degraded: Optional[Plan] = None  # while growing back: the plan that served before
        while not self._stopping.is_set():
            try:
                launch = self._launch = self._start(plan)
            except (OSError, UserError) as e:  # the launcher cannot be run, or its hostfile cut
                self.error = f"cannot start the rank job: {e}"
                self._set("stopped", None)
                _say(f"error: {self.error}")
                return
            served = self._until_serving(launch, loss)
            if self._stopping.is_set():
                return
            if served and self._until_regrow_or_end(launch):
                self._set("recovering", None)
                _say(f"growing back to {len(self._full.slots)} ranks")
                self._end_cleanly(launch)
                plan, loss, degraded = self._full, None, plan
                continue
            launch.end(END_GRACE)
            if self._stopping.is_set():
                return
            seen_at = launch.loss_seen_at or time.time()
            loss = read_loss(launch.text(), plan.slots, seen_at)
            if loss is None and degraded is not None and not served:  # growing back failed: serve as before
                _say(f"error: growing back to {len(plan.slots)} ranks failed (exit status {launch.proc.returncode}): "
                     f"serving on {len(degraded.slots)} again, without growing back")
                self._regrow_off = True
                plan, degraded = degraded, None
                continue
            degraded = None
            if loss is None:
                self._stop_by_itself(launch, served)
                return
            try:
                plan = survivors_plan(plan, loss, self.spec.min_ranks, option(plan.serve_args, "--record-routing"),
                                      self._scratch)
            except UserError as e:
                self._stop_by_itself(launch, served, f"lost rank(s) {loss.ranks}: {e}")
                return
            _say(f"lost rank(s) {loss.ranks} (host {', '.join(sorted(set(loss.hosts)))}): starting again on "
                 f"{len(plan.slots)}")

    def _until_serving(self, launch: Launch, loss: Optional[Loss]) -> bool:
        """Wait for the serving line (True) or the start's end or a sign of loss (False)."""
        while not self._stopping.is_set():
            launch.changed.wait(1.0)
            launch.changed.clear()
            if launch.loss_seen_at is not None or launch.proc.poll() is not None:
                self._set("recovering" if self.state != "starting" else "starting", None)
                return False
            if launch.ready is not None:
                self._set("ok" if len(self._plan.slots) == len(self._full.slots) else "degraded",
                          f"http://127.0.0.1:{launch.ready.group(1)}")
                if loss is not None:
                    self.last_recovery = loss.record(time.time())
                    self.recoveries += 1
                elif len(self._plan.slots) == len(self._full.slots) and self.recoveries:
                    self.regrown_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
                return True
        return False

    def _until_regrow_or_end(self, launch: Launch) -> bool:
        """While serving: True when it is time to grow back, False when the start ends or loses a rank."""
        next_try = time.monotonic() + self.spec.regrow_every
        while not self._stopping.is_set():
            launch.changed.wait(1.0)
            launch.changed.clear()
            if launch.loss_seen_at is not None or launch.proc.poll() is not None:
                self._set("recovering", None)
                return False
            if self.state != "degraded" or not self.spec.regrow or self._regrow_off or time.monotonic() < next_try \
                    or self._live:
                continue
            lost = [s.host for s in self._full.slots]
            for s in self._plan.slots:
                lost.remove(s.host)
            if all(host_answers(h, self.spec.launcher, self._program) for h in set(lost)):
                with self._lock:
                    if self._live == 0:
                        self._set("recovering", None)  # no new request reaches this job now
                        return True
            next_try = time.monotonic() + self.spec.regrow_every
        return False

    def _set(self, state: str, base_url: Optional[str]) -> None:
        """The job's state and address, unless the front is stopping it (then: stopped)."""
        with self._lock:
            if self._stopping.is_set():
                state, base_url = "stopped", None
            self.state, self.base_url = state, base_url

    def _end_cleanly(self, launch: Launch) -> None:
        pid = self._rank0_pid(launch)
        if pid is not None:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGINT)
        launch.end(STOP_GRACE if pid is not None else END_GRACE)

    def _stop_by_itself(self, launch: Launch, served: bool, why: Optional[str] = None) -> None:
        code = launch.proc.returncode
        errors = [l.strip() for l in launch.said if "error" in l.lower()]
        self.error = why or (errors[-1] if errors else f"the rank job exited with status {code}")
        self._set("stopped", None)
        _say(f"error: the rank job {'stopped serving' if served else 'did not start'} and no rank was lost "
             f"(exit status {code}): not starting it again" if why is None else f"error: {why}")


def _say(text: str) -> None:
    print(f"mlxdist.front: {text}", file=sys.stderr, flush=True)


def _echo(line: str) -> None:
    sys.stderr.write(line)
    sys.stderr.flush()
