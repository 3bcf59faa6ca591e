"""Which launcher started this process, and what it says before MPI starts
(the job's size, this rank), from its variables: Open MPI's ``mpirun``, or
MLX's ``mlx.launch``; and a launch tried again where Open MPI's launcher
failed before any rank ran.
"""

import time
from typing import Any, Callable

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


# Open MPI's launcher sometimes fails before starting any rank, with this on
# stderr; nothing of ours ran, so the launch may be tried again.
LAUNCHER_FAILURE = "The PMIx server's listener thread failed to start"
LAUNCHER_RETRIES = 3


def retry_launcher(start: Callable[[], Any]) -> Any:
    """``start()`` (runs a launch to its end; returns something with
    ``returncode`` and ``stderr``), again while Open MPI's launcher failed
    before any rank ran, up to ``LAUNCHER_RETRIES`` times; the last result."""
    for _ in range(LAUNCHER_RETRIES + 1):
        proc = start()
        if proc.returncode == 0 or LAUNCHER_FAILURE not in proc.stderr:
            break
        time.sleep(1)
    return proc
