"""Which launcher started this process, and what it says before MPI starts
(the job's size, this rank), from its variables: Open MPI's ``mpirun``, or
MLX's ``mlx.launch``; and the folder an mpirun launch keeps its session in.
"""

import contextlib
import shutil
import tempfile
from typing import Dict, Iterator, Optional

from mlxdist import envs


def launcher_size() -> int:
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
    return envs.is_set("MLX_RANK") and launcher_size() <= 1


MLX_LAUNCH_MPI = ("--backend mpi needs MPI, which mlx.launch does not start here: use mlx.launch --backend mpi "
                  "(it runs mpirun), or --backend ring | jaccl")


# Open MPI 5.0's mpirun keeps its session's rendezvous files in <base>/ompi.<its pid>/, and a
# start fails ("The PMIx server's listener thread failed to start", status 213, before any rank
# runs) where an mpirun of the same pid and host was killed and left its own: PMIx 5.0 will not
# write over one. Pids come round (32768 on Linux by default), so a launch that followed some
# SIGKILLed ones failed at random. Each launch of ours takes a base of its own, removed after it.
SESSION_BASE = "PRTE_MCA_prte_local_tmpdir_base"


def new_session_base(parent: Optional[str] = None) -> str:
    """A new, empty folder for one launch's Open MPI session (``SESSION_BASE``
    in mpirun's environment); the launch removes it once mpirun has ended."""
    return tempfile.mkdtemp(prefix="mlxdist-launch.", dir=parent)


@contextlib.contextmanager
def own_session(env: Dict[str, str]) -> Iterator[Dict[str, str]]:
    """``env`` for one mpirun launch run inside the block, with a session base
    of its own (``new_session_base``), removed as the block ends."""
    base = new_session_base()
    try:
        yield {**env, SESSION_BASE: base}
    finally:
        shutil.rmtree(base, ignore_errors=True)
