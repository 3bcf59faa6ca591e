"""How a rank's process ends: its exit status (``set_exit_code``), MPI
finalized once at exit and the process then ended with ``os._exit`` (MLX's
group would otherwise call ``MPI_Finalize`` again from a destructor during
interpreter teardown), or not finalized where a thread waits in a collective
that will never end (``leave_mpi_unfinalized``); ``launch/mpirun`` told when
a job that lost a rank ends (``tell_the_launch``); the whole job ended at once
(``abort``), and a function run so that an exception it lets out ends every
rank with one line (``run_or_abort``).
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import TYPE_CHECKING, Optional

from mlxdist.errors import RankLost, failure_line, keep_traceback, say_error
from mlxdist.runtime import survival
from mlxdist.runtime.launcher import launch_fifo
from mlxdist.runtime.plane import SoloControl

if TYPE_CHECKING:
    from mlxdist.runtime.world import World


_EXIT_CODE = 0
_LOST: Optional[str] = None  # leave_mpi_unfinalized's line: a rank was lost, MPI is stuck
PIPE_ATOMIC = 512  # bytes a FIFO takes in one write on every POSIX system


def leave_mpi_unfinalized(lost: str) -> None:
    """At exit, end the process without ``MPI_Finalize``: a rank was lost
    (``lost``: the heartbeat's line) and a thread of this one waits in a
    collective that will never end (``heartbeat.ON_LOST``), where finalizing
    would wait with it; and tell the launch as it ends there (``tell_the_launch``)."""
    global _LOST
    _LOST = lost


def tell_the_launch(line: str) -> None:
    """Write ``line`` to ``MLXDIST_LAUNCH_ENDED`` (launch/mpirun's FIFO,
    where it is on this host) without waiting, as this process ends a job
    that lost a rank: mpirun would wait minutes for a host it cannot reach,
    and launch/mpirun ends it 5 s later."""
    fd = launch_fifo("MLXDIST_LAUNCH_ENDED")
    if fd is None:
        return
    try:
        os.write(fd, line.encode()[:PIPE_ATOMIC - 1] + b"\n")
    except OSError:
        pass
    finally:
        os.close(fd)


def _end_process() -> None:
    """Flush, tell the launch where a rank was lost, and end with the status set."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    if _LOST is not None:
        tell_the_launch(_LOST)
    os._exit(_EXIT_CODE)


def set_exit_code(code: int) -> None:
    """The status this process ends with once Python exits (see ``finalize_and_exit``)."""
    global _EXIT_CODE
    _EXIT_CODE = int(code)


def failing_excepthook(hook):
    def excepthook(kind, value, tb):
        set_exit_code(1)
        hook(kind, value, tb)

    return excepthook


def finalize_if_started() -> None:
    """Under ``mpirun -np 1``: MLX's first backend that starts is MPI's where
    it finds the library (``MLX_MPI_LIBNAME``), and mpirun reports a process
    that started MPI and did not finalize it as exiting improperly (status 1):
    finalize it at exit, as with more ranks."""
    import mpi4py

    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = False
    from mpi4py import MPI

    if MPI.Is_initialized():
        sys.excepthook = failing_excepthook(sys.excepthook)
        atexit.register(finalize_and_exit)


def exit_without_mpi() -> None:
    """At exit under mlx.launch: end the process before MLX's group is torn
    down at interpreter exit; status as ``finalize_and_exit``."""
    _end_process()


def finalize_and_exit() -> None:
    """At exit: finalize MPI once and end the process, before MLX's group can
    finalize it a second time. Left to itself, MPI is not finalized at all
    once a daemon thread (the watchdog's) is alive, and mpirun reports an
    improper exit. Exit status: ``set_exit_code``'s, or 1 after an uncaught
    exception."""
    MPI = _mpi()
    if not MPI.Is_finalized() and not survival.enabled() and _LOST is None:  # with ULFM it hangs
        MPI.Finalize()
    _end_process()


def abort(world: Optional[World], code: int = 1) -> None:
    """End every rank of the job now (last resort for an unexpected error)."""
    (world.control if world is not None else SoloControl()).abort(code)


def run_or_abort(world: World, fn, *args):
    """``fn(*args)``; an exception it lets out ends the whole job with one
    line naming this rank, never a rank left waiting in a collective; a
    lost rank (``RankLost``) is its line and status 1."""
    try:
        return fn(*args)
    except KeyboardInterrupt:
        abort(world, 130)
    except RankLost as e:  # rank 0's API caller heard the heartbeat's verdict: the job ends with this process
        say_error(str(e))
        set_exit_code(1)
        return 1
    except Exception as e:
        stop_job(world, e)


def stop_job(world: World, error: BaseException) -> None:
    """End every rank now with one line naming this rank and ``error`` and
    where its traceback went. Called in ``except``."""
    path = keep_traceback(world.rank)
    where = f" (traceback: {path})" if path else ""
    say_error(f"{failure_line(world.rank, error)}{where}")
    abort(world, 1)


def _mpi():
    from mpi4py import MPI

    return MPI
