"""Which launcher started this process, and what it says before MPI starts
(the job's size, this rank), from its variables: Open MPI's ``mpirun``, or
MLX's ``mlx.launch``; the FIFOs ``launch/mpirun`` hands the ranks; and the
folder an mpirun launch keeps its sessions in.
"""

import contextlib
import os
import shutil
import socket
import stat
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


def launch_fifo(variable: str) -> Optional[int]:
    """A non-blocking write end of the FIFO ``launch/mpirun`` names in
    ``variable`` (``MLXDIST_STDOUT``, ``MLXDIST_LAUNCH_ENDED``), where that
    is set, this is launch/mpirun's host (``MLXDIST_LAUNCH_HOST``) and it
    reads the FIFO; else None."""
    path = envs.get(variable)
    if not path:
        return None
    host = envs.get("MLXDIST_LAUNCH_HOST")
    if host and host != socket.gethostname():  # the same path on another host (a shared /tmp) is not ours
        return None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO where nothing reads it here
    except OSError:
        return None
    if not stat.S_ISFIFO(os.fstat(fd).st_mode):  # a file of that name is not the wrapper's: leave it be
        os.close(fd)
        return None
    return fd


# Open MPI 5.0's launcher (mpirun) and its daemons (prted, on the other hosts) keep their session's
# rendezvous files in <base>/ompi.<pid>/ and <base>/prted.<pid>/, and one fails to start ("The
# PMIx server's listener thread failed to start", status 213, before any rank runs) where a
# process of the same pid and host was killed and left its own: PMIx 5.0 will not write over
# them. Pids come round (32768 on Linux by default), so after some killed jobs a launch failed at
# random. Each launch of ours gives both a base of its own in /tmp, a path every host has
# (mpirun and prted create it), and removes it on its own host once mpirun has ended; on the other
# hosts the daemons leave it empty, to the system's /tmp cleaning.
SESSION_VARIABLES = ("PRTE_MCA_prte_local_tmpdir_base", "PRTE_MCA_prte_remote_tmpdir_base")
SESSIONS_PARENT = "/tmp"


def new_session_base(parent: str = SESSIONS_PARENT) -> str:
    """A new, empty folder for one launch's Open MPI sessions, in ``parent``."""
    return tempfile.mkdtemp(prefix="mlxdist-launch.", dir=parent)


def session_env(base: str) -> Dict[str, str]:
    """The variables that put a launch's Open MPI sessions in ``base`` (mpirun's
    here, the daemons' on the other hosts)."""
    return {name: base for name in SESSION_VARIABLES}


@contextlib.contextmanager
def own_session(env: Dict[str, str]) -> Iterator[Dict[str, str]]:
    """``env`` for one mpirun launch run inside the block, with a session base
    of its own (``new_session_base``), removed as the block ends."""
    base = new_session_base()
    try:
        yield {**env, **session_env(base)}
    finally:
        shutil.rmtree(base, ignore_errors=True)
