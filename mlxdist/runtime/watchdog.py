"""No hangs: every rank knows what it is doing, and says so when it stops.

``ACTIVITY`` is this rank's current phase, MoE layer and forward step,
updated on the hot path with a few attribute stores. Two daemon threads read
it:

- the launcher thread: when a peer dies, mpirun sends the survivors SIGTERM.
  The main thread may be blocked inside MPI, where no Python handler runs, so
  the signal is read from a wakeup fd by this thread, which prints what this
  rank was waiting for (and which local peer is gone) and exits;
- the deadline thread: when a generation finishes no work for ``timeout``
  seconds (a rank hung), it prints the same report and exits non-zero, which
  makes mpirun stop the whole job.

Progress is finished work, not graph building (MLX builds a whole step's
graph in milliseconds and runs it later): a token read back, a p2p exchange
answered, or a forward pass beginning, which in every generation loop here
(mlx-lm's, engine/dp_schedule.py) comes after the host has read the results of the step two
back. While the latest forward is a prefill (more than one token per
sequence: one long evaluation, and a first CUDA launch compiles for minutes)
the deadline is ``PREFILL_FACTOR`` times longer.

A rank that stops answering altogether (asleep, cut off, stopped) is lost
sooner, after ``--heartbeat`` seconds, by ``heartbeat.py``.

Faults for tests are injected by ``faults.py`` (``MLXDIST_FAULT``).
"""

import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

from mlxdist.errors import say_error
from mlxdist.runtime.world import World

DEFAULT_TIMEOUT = 120.0
PREFILL_FACTOR = 10


@dataclass
class Activity:
    phase: str = "idle"  # idle | dense | experts | exchange | serving | shares
    layer: Optional[int] = None
    step: int = 0
    waiting_on: List[int] = field(default_factory=list)
    since: float = field(default_factory=time.monotonic)  # when the phase began
    done: float = field(default_factory=time.monotonic)  # when work last finished
    prefill: bool = False  # the latest forward pass is a prefill
    armed: bool = False  # a generation is running: the deadline applies
    serving_http: bool = False  # the server's loop: any step may be a long prefill (the prefill deadline)

    def at(self, phase: str, layer: Optional[int] = None, waiting_on: Optional[List[int]] = None) -> None:
        """Where this rank is now (for reports); not progress."""
        self.phase, self.layer = phase, layer
        self.waiting_on = waiting_on or []
        self.since = time.monotonic()

    def progress(self) -> None:
        """Work finished (a token read, an exchange answered)."""
        self.done = time.monotonic()

    def begin_forward(self, prefill: bool) -> None:
        """A forward pass begins: the host has read the step two back."""
        self.step += 1
        self.prefill = prefill
        self.done = time.monotonic()

    def describe(self) -> str:
        where = f"step {self.step}" if self.layer is None else f"layer {self.layer} of step {self.step}"
        what = {
            "exchange": "waiting in the expert exchange",
            "experts": "computing its experts",
            "dense": "running the dense layers",
            "serving": "waiting for rank 0",
            "shares": "waiting for the other ranks' shares of the batch",
            "serving-http": "in the server's generation loop",
        }.get(self.phase, self.phase)
        return f"{what} during {where}"


ACTIVITY = Activity()
# Phases in which a rank waits for others' work, not its own: no deadline (the others have theirs).
WAITING = ("serving", "shares")
# Called (in the reporting thread) before this rank exits because the job is
# being stopped, e.g. the server's answer to a lost rank; given a moment to act.
ON_FATAL: List[Callable[[], None]] = []
FATAL_GRACE = 1.5  # seconds
# Whether this process itself was just held up (stopped, then continued): then
# the launcher's stop is about it, lost to the others, and it has nothing to report.
HELD_UP: List[Callable[[], bool]] = []


class Watchdog:
    def __init__(self, world: World, timeout: float):
        self.world = world
        self.timeout = timeout
        self.peers: List[Tuple[str, int]] = [tuple(p) for p in world.control.allgather_json([socket.gethostname(), os.getpid()])]

    def start(self) -> None:
        if self.world.size == 1:
            return
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        signal.set_wakeup_fd(write_fd)
        signal.signal(signal.SIGTERM, lambda *_: None)
        threading.Thread(target=self._on_signal, args=(read_fd,), daemon=True).start()
        threading.Thread(target=self._deadline, daemon=True).start()

    def gone(self) -> List[int]:
        """Ranks on this host whose process no longer exists."""
        here = socket.gethostname()
        dead = []
        for rank, (host, pid) in enumerate(self.peers):
            if rank == self.world.rank or host != here:
                continue
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                dead.append(rank)
        return dead

    def report(self, headline: str) -> None:
        a = ACTIVITY
        gone = self.gone()
        waiting = f" on rank{'s' if len(a.waiting_on) > 1 else ''} {', '.join(map(str, a.waiting_on))}" if a.waiting_on else ""
        line = f"rank {self.world.rank}: {headline} while {a.describe()}{waiting}"
        if gone:
            line += f"; rank{'s' if len(gone) > 1 else ''} {', '.join(map(str, gone))} stopped (process gone)"
        say_error(line)

    def _on_signal(self, read_fd: int) -> None:
        os.read(read_fd, 1)
        # A clean shutdown raced the launcher, or this rank was the one lost: nothing to report.
        if ACTIVITY.phase != "exiting" and not any(held_up() for held_up in HELD_UP):
            self.report("the job was stopped")
        run_on_fatal()
        os._exit(1)

    def _deadline(self) -> None:
        while True:
            time.sleep(min(0.5, self.timeout / 4))
            a = ACTIVITY
            limit = self.timeout * (PREFILL_FACTOR if a.prefill or a.serving_http else 1)
            if a.armed and a.phase not in WAITING and a.phase != "exiting" and time.monotonic() - a.done > limit:
                self.report(f"no progress for {limit:g} s")
                # Ranks stalled together pass their deadlines moments apart: let
                # the others (the one really stuck among them) speak before this
                # exit makes mpirun stop them.
                if not run_on_fatal():
                    time.sleep(min(2.0, self.timeout))
                os._exit(1)


def run_on_fatal() -> bool:
    """Run the ``ON_FATAL`` callbacks and give them ``FATAL_GRACE``; whether there were any."""
    for callback in ON_FATAL:
        callback()
    if ON_FATAL:
        time.sleep(FATAL_GRACE)
    return bool(ON_FATAL)


def start_watchdog(world: World, timeout: float) -> Watchdog:
    """Start the deadline and the launcher-signal report."""
    dog = Watchdog(world, timeout)
    dog.start()
    return dog
