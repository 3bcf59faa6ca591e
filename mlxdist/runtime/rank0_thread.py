"""Rank 0's side of the API's commands on a thread of its own, so that the
caller hears of a lost rank as ``RankLost`` within the heartbeat.

A rank that stops answering leaves rank 0 inside a collective (an MLX
``all_sum`` in the middle of a forward pass, a control-plane broadcast),
in C, where no Python exception can reach it. So every command the
``Cluster`` sends runs here, on one daemon thread (the same thread for all,
as MLX and the control plane expect one caller at a time), while the
caller's thread waits on a condition that either the command's end or
the heartbeat's verdict (``heartbeat.ON_LOST``) wakes. On a verdict the
caller raises ``RankLost`` with the heartbeat's line and the thread is left
where it is: the job cannot go on, the ``Cluster`` refuses every further
command with the same error, and the process ends without finalizing MPI
(``world.leave_mpi_unfinalized``). The ranks left wait until it does
(``heartbeat.HOLD``), so that a script may catch the error and save what
it has first.
"""

import threading
from typing import Any, Callable, List, Optional, TypeVar

from mlxdist.errors import RankLost

T = TypeVar("T")


class _Call:
    __slots__ = ("fn", "args", "kwargs", "done", "value", "error")

    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict):
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.done = False
        self.value: Any = None
        self.error: Optional[BaseException] = None


class Rank0Thread:
    """Runs ``call``'s functions one at a time on a thread of its own; a
    caller waiting on one raises ``RankLost`` as soon as ``lost`` is told."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._queue: List[_Call] = []
        self._thread: Optional[threading.Thread] = None
        self.lost_line: Optional[str] = None  # the heartbeat's line, once a rank is lost

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)``'s value (or its exception), computed on
        this object's thread; ``RankLost`` if a rank is lost before it ends
        or was lost already. Called from that thread itself, ``fn`` runs at once."""
        if threading.current_thread() is self._thread:
            return fn(*args, **kwargs)
        call = _Call(fn, args, kwargs)
        with self._changed:
            self._raise_if_lost()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mlxdist-rank0", daemon=True)
                self._thread.start()
            self._queue.append(call)
            self._changed.notify_all()
            while not call.done and self.lost_line is None:
                self._changed.wait()
            if not call.done:
                self._raise_if_lost()
        if call.error is not None:
            error, call.error = call.error, None  # no cycle through the traceback's frames
            raise error
        return call.value

    def lost(self, line: str) -> None:
        """The heartbeat's verdict (``heartbeat.ON_LOST``): every waiting
        and later caller raises ``RankLost(line)``."""
        with self._changed:
            if self.lost_line is None:
                self.lost_line = line
            self._changed.notify_all()

    def _raise_if_lost(self) -> None:
        if self.lost_line is not None:
            raise RankLost(self.lost_line)

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._queue:
                    self._changed.wait()
                call = self._queue.pop(0)
            try:
                call.value = call.fn(*call.args, **call.kwargs)
            except BaseException as e:  # handed to the caller, whatever it is
                call.error = e
            with self._changed:
                call.done = True
                self._changed.notify_all()
