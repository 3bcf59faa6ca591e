"""Going on without a rank, inside the running job: Open MPI's fault
tolerance (ULFM), enabled by launching with ``launch/mpirun --survive``
(``mpirun --with-ft ulfm`` and its failure detector, ``MPIRUN_FT_FLAGS``).

Then the control communicator returns errors instead of aborting, and a lost
rank is handled in one place, ``recover``: the communicator is revoked (every
survivor's pending call on it fails, so every survivor comes here), the
survivors agree once and shrink it to themselves, and each
``World.on_loss`` callback runs (rank 0 takes over the lost ranks' experts,
``engine.Engine.adopt``). Ranks keep their original numbers everywhere
(placement, ownership, messages); ``World.alive`` maps them to the new
communicator.

Control collectives run through ``agreed``: after the call the survivors
agree (``MPI_Comm_agree``, which completes on every survivor even after a
failure) whether it succeeded everywhere, and if not they recover and run
it again, so no survivor goes on with a result another did not get. That
agreement is the one ``recover`` makes: a survivor that was exchanging
experts when the communicator was revoked and one that was in a control
collective call the same two collectives (agree, then shrink).

MLX's own collectives do not survive a lost peer: only ``--mode p2p``
(mpi4py alone, on this communicator) goes on; the other modes end the job.
"""

import os
import sys
import time
from typing import Any, Callable, List

from mlxdist import envs
from mlxdist.errors import say_error

# The failure detector runs in MPI's progress engine, not a thread of its own: with
# mpi_ft_detector_thread on, Open MPI 5 crashes a rank inside MPI's start-up (a null function
# call) in about one launch in eight on a 2-core Linux host (5 of 40; 0 of 40 without it).
MPIRUN_FT_FLAGS = ["--with-ft", "ulfm", "--mca", "mpi_ft_enable", "true", "--mca", "mpi_ft_detector", "true",
                   "--mca", "mpi_ft_detector_thread", "false"]


def enabled() -> bool:
    """Whether this job was launched with Open MPI's fault tolerance on."""
    return envs.get("OMPI_MCA_mpi_ft_enable")


def tolerate(comm) -> None:
    """Make ``comm``'s errors return as exceptions instead of aborting."""
    from mpi4py import MPI

    comm.Set_errhandler(MPI.ERRORS_RETURN)


def peer_errors(world) -> tuple:
    """What an ``except`` clause catches to recover from a lost peer: MPI's
    errors in a fault-tolerant job, nothing otherwise (there a lost rank
    ends the job)."""
    if not world.tolerant:
        return ()
    from mpi4py import MPI

    return (MPI.Exception,)


def recover(world, agreed: bool = False) -> List[int]:
    """Revoke the world's communicator, agree (unless the caller just did),
    shrink it to the survivors, run the ``on_loss`` callbacks; the original
    ranks lost. Every survivor calls it."""
    from mpi4py import MPI

    tic = time.perf_counter()
    old = world.comm
    _end_if_root_lost(world)
    old.Revoke()
    if not agreed:
        try:
            old.Agree(0)
        except MPI.Exception:
            pass
    new = old.Shrink()
    tolerate(new)
    before = MPI.Group.Translate_ranks(new.Get_group(), list(range(new.Get_size())), old.Get_group())
    alive = [world.alive[r] for r in before]
    lost = [r for r in world.alive if r not in alive]
    world.comm, world.alive = new, alive
    world.lost.extend(lost)
    if 0 not in alive:
        _root_lost(world)
    for callback in world.on_loss:
        callback(lost)
    if world.is_root and lost:
        names = ", ".join(map(str, lost))
        print(f"mlxdist: warning: lost rank{'s' if len(lost) > 1 else ''} {names}; going on with "
              f"{len(alive)} (recovered in {time.perf_counter() - tic:.2f} s)", file=sys.stderr, flush=True)
    return lost


def _end_if_root_lost(world) -> None:
    """End this rank if it knows rank 0 failed, before any agreement: Open MPI 5.0's
    agreement was seen to crash (ftagree) when the failed process was rank 0."""
    from mpi4py import MPI

    comm = world.comm
    failed = comm.Get_failed()
    positions = MPI.Group.Translate_ranks(failed, list(range(failed.Get_size())), comm.Get_group())
    if any(p != MPI.UNDEFINED and world.alive[p] == 0 for p in positions):
        _root_lost(world)


ROOT_LOST_GRACE_S = 2.0


def _root_lost(world) -> None:
    """The command loop and the dense model are gone: every survivor ends here, with one line.
    It waits ``ROOT_LOST_GRACE_S`` before exiting: mpirun ends the job (closing every rank's
    output) as soon as one rank exits non-zero, and the other survivors' lines would be lost."""
    try:
        say_error(f"rank {world.rank}: rank 0 was lost; the job cannot go on without it")
    except OSError:  # mpirun already closed this rank's output
        pass
    time.sleep(ROOT_LOST_GRACE_S)
    os._exit(1)


def agreed(world, op: Callable[[Any], Any]) -> Any:
    """``op(comm)``, a control collective, completed by every surviving rank:
    retried on the shrunk communicator after a loss (see the module's docstring)."""
    if not world.tolerant:
        return op(world.comm)
    from mpi4py import MPI

    while True:
        try:
            result, ok = op(world.comm), 1
        except MPI.Exception:
            result, ok = None, 0
            _end_if_root_lost(world)
        try:
            ok = world.comm.Agree(ok)
        except MPI.Exception:  # a failure not yet acknowledged: the same answer on every survivor
            ok = 0
        if ok:
            return result
        if not recover(world, agreed=True):  # no rank lost: a real error, which retrying would repeat
            raise RuntimeError("a control collective failed on a rank without any rank lost")
