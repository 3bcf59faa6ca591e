"""MLX's ring and JACCL backends: started under mpirun from what the job
knows, or found as ``mlx.launch`` left them.

Under mpirun, mpi4py is up first (it keeps the control plane) and the ranks
tell each other, over it, what MLX's backend needs; then MLX starts on it:

- ring (TCP): each rank's address (127.0.0.1 when the whole job is on one
  host; else the address of ``MLXDIST_RING_INTERFACE`` if named, else its
  host name's) and a port free on its own host, gathered on every rank and
  written as MLX's ring hostfile, ``[["ip:port"], ...]`` one list per rank,
  to a temporary file named by ``MLX_HOSTFILE``, with ``MLX_RANK``.
- jaccl (RDMA over Thunderbolt, macOS 26.2+): the RDMA device matrix
  ``MLXDIST_JACCL_DEVICES`` names (``[[null, "rdma_en3"], ["rdma_en3",
  null]]``: row i, column j is the device rank i reaches rank j by; or a
  hostfile from ``mlx.distributed_config`` with its ``rdma`` rows) in a
  temporary file named by ``MLX_IBV_DEVICES``, and rank 0's address with a
  port free there as ``MLX_JACCL_COORDINATOR``. Where this MLX has no JACCL
  (any Linux build) the job is refused in one line.

Under ``mlx.launch`` the launcher has set all of that; ``launched_backend``
reads which backend it chose from what it set.
"""

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from mlxdist import envs
from mlxdist.runtime.plane import comm_allgather_json


def free_port() -> int:
    """A TCP port free on this host now."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def interface_address(name: str) -> str:
    """The IPv4 address of network interface ``name`` (e.g. ``bridge0``, the
    Thunderbolt bridge on macOS, or ``en5``)."""
    if sys.platform.startswith("linux"):
        import fcntl
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
            except OSError:
                raise RuntimeError(f"MLXDIST_RING_INTERFACE={name}: no IPv4 address on that interface here") from None
        return socket.inet_ntoa(packed[20:24])
    out = subprocess.run(["ifconfig", name], capture_output=True, text=True).stdout.split()
    for word, value in zip(out, out[1:]):
        if word == "inet":
            return value
    raise RuntimeError(f"MLXDIST_RING_INTERFACE={name}: no IPv4 address on that interface here")


def ring_hosts(entries: List[Tuple[str, str, int]]) -> List[List[str]]:
    """MLX's ring hostfile from each rank's (host name, address, port), in
    rank order: loopback for every rank when they share one host."""
    one_host = len({name for name, _, _ in entries}) == 1
    return [[f"{'127.0.0.1' if one_host else address}:{port}"] for _, address, port in entries]


def _my_address() -> str:
    interface = envs.get("MLXDIST_RING_INTERFACE")
    if interface:
        return interface_address(interface)
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _write_temp(prefix: str, obj: Any) -> str:
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f)
    return path


def start_ring(comm):
    """MLX's ring group over the mpirun job ``comm`` spans."""
    import mlx.core as mx

    mine = [socket.gethostname(), _my_address(), free_port()]
    hosts = ring_hosts([tuple(e) for e in comm_allgather_json(comm, mine)])
    path = _write_temp("mlxdist-ring-", hosts)
    envs.put("MLX_HOSTFILE", path)
    envs.put("MLX_RANK", comm.Get_rank())
    try:
        return mx.distributed.init(backend="ring", strict=True)
    except RuntimeError as e:
        raise RuntimeError(f"MLX's ring backend did not start: {e}") from None
    finally:
        os.unlink(path)  # read by the init


def read_devices(path: str, size: int) -> List[List[Optional[str]]]:
    """The RDMA device matrix for ``size`` ranks from ``path``: the matrix
    itself, or an ``mlx.distributed_config`` hostfile (its hosts' ``rdma``);
    checked as ``mlx.launch`` checks it (one line per problem)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise RuntimeError(f"MLXDIST_JACCL_DEVICES={path}: cannot read it as JSON ({e})") from None
    if isinstance(data, dict):
        data = [h.get("rdma", []) for h in data.get("hosts", [])]
    if not isinstance(data, list) or len(data) != size or any(not isinstance(r, list) or len(r) != size for r in data):
        raise RuntimeError(f"MLXDIST_JACCL_DEVICES={path}: needs {size} rows of {size} RDMA device names "
                           f"(one row per rank), for a job of {size} ranks")
    if any(data[i][i] is not None for i in range(size)):
        raise RuntimeError(f"MLXDIST_JACCL_DEVICES={path}: a rank's own entry (the diagonal) must be null")
    missing = [(i, j) for i in range(size) for j in range(size) if i != j and not data[i][j]]
    if missing:
        raise RuntimeError(f"MLXDIST_JACCL_DEVICES={path}: no RDMA device from rank {missing[0][0]} "
                           f"to rank {missing[0][1]} (JACCL needs a cable between every pair)")
    return data


def jaccl_environment(rank: int, devices: List[List[Optional[str]]], coordinator: str) -> Dict[str, str]:
    """What MLX's JACCL init reads, for ``rank``: the device file's content
    (written to a file named by ``MLX_IBV_DEVICES``), the coordinator and
    the rank."""
    return {"MLX_IBV_DEVICES": json.dumps(devices), "MLX_JACCL_COORDINATOR": coordinator, "MLX_RANK": str(rank)}


JACCL_MISSING = ("the jaccl backend needs MLX's RDMA support (macOS 26.2 or later, RDMA enabled with "
                 "'rdma_ctl enable' in Recovery, Thunderbolt 5 cables); this MLX has none: use --backend ring")


def start_jaccl(comm):
    """MLX's JACCL group over the mpirun job ``comm`` spans."""
    import mlx.core as mx

    if not mx.distributed.is_available("jaccl"):
        raise RuntimeError(JACCL_MISSING)
    path = envs.get("MLXDIST_JACCL_DEVICES")
    if path is None:
        raise RuntimeError("the jaccl backend needs MLXDIST_JACCL_DEVICES: the file of RDMA device names "
                           "between the ranks (mlx.distributed_config --backend jaccl writes one)")
    devices = read_devices(str(path), comm.Get_size())
    entries = comm_allgather_json(comm, [socket.gethostname(), _my_address(), free_port()])
    one_host = len({name for name, _, _ in entries}) == 1
    coordinator = f"{'127.0.0.1' if one_host else entries[0][1]}:{entries[0][2]}"
    env = jaccl_environment(comm.Get_rank(), devices, coordinator)
    device_file = _write_temp("mlxdist-jaccl-", devices)
    envs.put("MLX_IBV_DEVICES", device_file)
    envs.put("MLX_JACCL_COORDINATOR", env["MLX_JACCL_COORDINATOR"])
    envs.put("MLX_RANK", env["MLX_RANK"])
    try:
        return mx.distributed.init(backend="jaccl", strict=True)
    except RuntimeError as e:
        raise RuntimeError(f"MLX's jaccl backend did not start: {e}") from None
    finally:
        os.unlink(device_file)


def launched_backend() -> str:
    """The backend ``mlx.launch`` started this process for, from what it set:
    jaccl (its device file), nccl (its rendezvous), else ring."""
    if envs.is_set("MLX_IBV_DEVICES") or envs.is_set("MLX_JACCL_COORDINATOR"):
        return "jaccl"
    if envs.is_set("NCCL_HOST_IP") and envs.is_set("MLX_WORLD_SIZE"):
        return "nccl"
    return "ring"


def hostfile_ranks() -> int:
    """How many ranks ``mlx.launch``'s ring hostfile lists (1: none, or empty)."""
    path = envs.get("MLX_HOSTFILE")
    if path is None:
        return 1
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return 1
    return len(json.loads(text)) if text else 1
