"""MLX's ring and JACCL backends: started under mpirun from what the job
knows, or found as ``mlx.launch`` left them.

Under mpirun, mpi4py is up first (it keeps the control plane) and the ranks
tell each other, over it, what MLX's backend needs; then MLX starts on it:

- ring (TCP): each rank's address toward its left neighbour, the one MLX's
  ring accepts from (``runtime/addresses.py``: 127.0.0.1 when they share a
  host; else the address of ``MLXDIST_RING_INTERFACE`` if named, else the
  one on the peer's network or route: one address per link, so a ring of
  cables works), and a port free on its own host, gathered on every rank
  and written as MLX's ring hostfile, ``[["ip:port"], ...]`` one list per
  rank, to a temporary file named by ``MLX_HOSTFILE``, with ``MLX_RANK``.
- jaccl and jaccl-ring (RDMA over Thunderbolt, macOS 26.2+): the RDMA
  device matrix ``MLXDIST_JACCL_DEVICES`` names (``[[null, "rdma_en3"],
  ["rdma_en3", null]]``: row i, column j is the device rank i reaches rank
  j by; or a hostfile from ``mlx.distributed_config`` with its ``rdma``
  rows) in a temporary file named by ``MLX_IBV_DEVICES``, and rank 0's
  address as rank 1 reaches it with a port free there as
  ``MLX_JACCL_COORDINATOR``. jaccl needs a cable between every pair;
  jaccl-ring (``MLX_JACCL_RING=1``, as ``mlx.launch`` sets it) only between
  neighbours. Where this MLX has no JACCL (any Linux build) the job is
  refused in one line.

A start that does not connect within ``MLXDIST_CONNECT_TIMEOUT`` seconds
ends the rank with one line (MLX's own start would wait forever).

Under ``mlx.launch`` the launcher has set all of that; ``launched_backend``
reads which backend it chose from what it set.
"""

import ipaddress
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from mlxdist import envs
from mlxdist.inputs import json_input
from mlxdist.errors import RankStartError
from mlxdist.runtime.addresses import address_toward, describe_host, interfaces, same_host
from mlxdist.runtime.plane import comm_allgather_json


def free_port() -> int:
    """A TCP port free on this host now."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def ring_hosts(entries: List[Tuple[str, str, int]]) -> List[List[str]]:
    """MLX's ring hostfile from each rank's (host, address, port), in rank
    order: loopback for every rank when they share one host."""
    one_host = len({name for name, _, _ in entries}) == 1
    return [[f"{'127.0.0.1' if one_host else address}:{port}"] for _, address, port in entries]


def _write_temp(prefix: str, obj: Any) -> str:
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f)
    return path


def _hosts(comm) -> List[Dict[str, Any]]:
    """Every rank's ``addresses.describe_host()``, in rank order."""
    return comm_allgather_json(comm, describe_host())


def _host_key(host: Dict[str, Any]) -> str:
    return json.dumps([host["name"], sorted(map(tuple, host["addresses"]))])


def start_ring(comm):
    """MLX's ring group over the mpirun job ``comm`` spans. MLX's ring has
    each rank accept its left neighbour's connection on the addresses it
    lists and connect to its right neighbour's: so each rank lists its
    address toward its left neighbour (one address per link, as a ring of
    cables needs)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    hosts = _hosts(comm)
    left = hosts[(rank - 1) % size]
    address = address_toward(hosts[rank], left, envs.get("MLXDIST_RING_INTERFACE"))
    entries = comm_allgather_json(comm, [_host_key(hosts[rank]), address, free_port()])
    ring = ring_hosts([tuple(e) for e in entries])
    path = _write_temp("mlxdist-ring-", ring)
    envs.put("MLX_HOSTFILE", path)
    envs.put("MLX_RANK", rank)
    right = (rank + 1) % size
    return _start_backend("ring", path, f"rank {rank} listens on {ring[rank][0]} for rank {(rank - 1) % size} "
                                        f"and connects to rank {right} at {ring[right][0]}")


class _Deadline:
    """Ends this rank with one line if the block outlasts
    ``MLXDIST_CONNECT_TIMEOUT`` seconds: MLX's ring and JACCL starts wait
    for a peer that cannot reach them forever, without a word, inside a C
    call that keeps Python's threads and signal handlers from running; so
    the watch is a small shell process beside the rank, which says the line
    and kills the rank, and which the block ends when it is over (or which
    ends by itself once the rank is gone)."""

    def __init__(self, message: str):
        self.message = message
        self.watch = None

    def __enter__(self):
        seconds = envs.get("MLXDIST_CONNECT_TIMEOUT")
        line = f"mlxdist: error: {self.message} within {seconds} s ({connect_failure_causes()})"
        script = ('i=0; while [ "$i" -lt "$1" ]; do sleep 1; kill -0 "$2" 2>/dev/null || exit 0; i=$((i+1)); '
                  'done; printf "%s\\n" "$3" >&2; kill -9 "$2"')
        self.watch = subprocess.Popen(["sh", "-c", script, "deadline", str(seconds), str(os.getpid()), line],
                                      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        return self

    def __exit__(self, *exc):
        self.watch.kill()
        self.watch.wait()
        return False


AUTO_SETUP_GONE = ("the Thunderbolt addresses mlx.distributed_config --auto-setup sets are gone after a Mac "
                   "restarts: run that command again (docs/macs.md#6-after-a-restart)")


def connect_failure_causes(darwin: bool = sys.platform == "darwin") -> str:
    """Why a backend's start did not connect, the likeliest first: on Macs,
    a restart since ``mlx.distributed_config --auto-setup``."""
    others = ("a firewall, a link down, or an address the peer cannot reach: check with python -m mlxdist.doctor "
              "--backend mpi")
    return f"likely {AUTO_SETUP_GONE}; else {others}" if darwin else others


def check_own_addresses(rank: int) -> None:
    """Under ``mlx.launch --backend ring``: raise ``RankStartError`` where
    this host has none of the IP addresses the hostfile (``MLX_HOSTFILE``)
    gives ``rank``: MLX's ring would wait forever for a peer to connect to
    an address no one listens at. Names that are not IP addresses are left
    to MLX."""
    path = envs.get("MLX_HOSTFILE")
    try:
        listed = json.loads(Path(path).read_text())[rank] if path else None
    except (OSError, ValueError, IndexError, KeyError, TypeError):
        return  # MLX reads the file itself and says what is wrong with it
    if not isinstance(listed, list):
        return
    wanted = []
    for entry in listed:
        host = str(entry).rsplit(":", 1)[0].strip("[]")
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return
        if address.is_loopback or address.is_unspecified:  # this host's whatever its interfaces
            return
        wanted.append(str(address))
    own = {address for _, address, _ in interfaces()}
    if wanted and not own.intersection(wanted):
        raise RankStartError(f"rank {rank}: this host has none of the addresses the ring hostfile gives it "
                             f"({', '.join(wanted)}); {AUTO_SETUP_GONE}")


def read_devices(path: str, size: int, ring: bool = False) -> List[List[Optional[str]]]:
    """The RDMA device matrix for ``size`` ranks from ``path``: the matrix
    itself, or an ``mlx.distributed_config`` hostfile (its hosts' ``rdma``);
    checked as ``mlx.launch`` checks it (one line per problem). ``ring``
    (jaccl-ring): only neighbours need a device between them."""
    data = json_input.read_file(path, "MLXDIST_JACCL_DEVICES", RuntimeError)
    if isinstance(data, dict):
        data = [h.get("rdma", []) if isinstance(h, dict) else None for h in data.get("hosts", [])]
    if not isinstance(data, list) or len(data) != size or any(not isinstance(r, list) or len(r) != size for r in data):
        raise RuntimeError(f"MLXDIST_JACCL_DEVICES={path}: needs {size} rows of {size} RDMA device names "
                           f"(one row per rank), for a job of {size} ranks")
    if any(data[i][i] is not None for i in range(size)):
        raise RuntimeError(f"MLXDIST_JACCL_DEVICES={path}: a rank's own entry (the diagonal) must be null")
    peers = (lambda i: {(i - 1) % size, (i + 1) % size}) if ring else (lambda i: range(size))
    missing = [(i, j) for i in range(size) for j in sorted(peers(i)) if i != j and not data[i][j]]
    if missing:
        needs = "a cable to each neighbour in the ring" if ring else "a cable between every pair (or use jaccl-ring)"
        raise RuntimeError(f"MLXDIST_JACCL_DEVICES={path}: no RDMA device from rank {missing[0][0]} "
                           f"to rank {missing[0][1]} (JACCL needs {needs})")
    return data


def jaccl_environment(rank: int, devices: List[List[Optional[str]]], coordinator: str,
                      ring: bool = False) -> Dict[str, str]:
    """What MLX's JACCL init reads, for ``rank``: the device file's content
    (written to a file named by ``MLX_IBV_DEVICES``), the coordinator, the
    rank and, for jaccl-ring, ``MLX_JACCL_RING`` (as ``mlx.launch`` sets it)."""
    env = {"MLX_IBV_DEVICES": json.dumps(devices), "MLX_JACCL_COORDINATOR": coordinator, "MLX_RANK": str(rank)}
    if ring:
        env["MLX_JACCL_RING"] = "1"
    return env


JACCL_MISSING = ("the jaccl backend needs MLX's RDMA support (macOS 26.2 or later, RDMA enabled with "
                 "'rdma_ctl enable' in Recovery, Thunderbolt 5 cables); this MLX has none: use --backend ring")


def coordinator_address(comm) -> str:
    """Rank 0's address as rank 1 reaches it (loopback when they share a
    host), the same on every rank: where JACCL's and NCCL's ranks meet."""
    hosts = _hosts(comm)
    address = address_toward(hosts[0], hosts[1 % len(hosts)], envs.get("MLXDIST_RING_INTERFACE"))
    if any(not same_host(hosts[0], h) for h in hosts) and address == "127.0.0.1":
        raise RuntimeError(f"rank 0's host {hosts[0]['name']} has no address its peers reach")
    return address


def start_jaccl(comm, ring: bool = False):
    """MLX's JACCL group over the mpirun job ``comm`` spans (``ring``: jaccl-ring)."""
    import mlx.core as mx

    if not mx.distributed.is_available("jaccl"):
        raise RuntimeError(JACCL_MISSING)
    path = envs.get("MLXDIST_JACCL_DEVICES")
    if path is None:
        raise RuntimeError("the jaccl backend needs MLXDIST_JACCL_DEVICES: the file of RDMA device names "
                           "between the ranks (mlx.distributed_config --backend jaccl writes one)")
    devices = read_devices(str(path), comm.Get_size(), ring)
    address = coordinator_address(comm)
    port = comm_allgather_json(comm, free_port())[0]  # rank 0's
    env = jaccl_environment(comm.Get_rank(), devices, f"{address}:{port}", ring)
    device_file = _write_temp("mlxdist-jaccl-", devices)
    envs.put("MLX_IBV_DEVICES", device_file)
    for name in ("MLX_JACCL_COORDINATOR", "MLX_RANK", "MLX_JACCL_RING"):
        if name in env:
            envs.put(name, env[name])
    return _start_backend("jaccl", device_file,
                          f"rank {comm.Get_rank()} meets the others at {env['MLX_JACCL_COORDINATOR']}")


def _start_backend(name: str, written: str, waiting: str):
    """MLX's ``name`` backend, ended in one line where it does not connect
    (``waiting``: who waits for whom); ``written``, the file its init reads,
    removed after."""
    import mlx.core as mx

    with _Deadline(f"MLX's {name} backend did not connect: {waiting}"):
        try:
            return mx.distributed.init(backend=name, strict=True)
        except RuntimeError as e:
            raise RuntimeError(f"MLX's {name} backend did not start: {e}") from None
        finally:
            os.unlink(written)


def launched_backend() -> str:
    """The backend ``mlx.launch`` started this process for, from what it set:
    jaccl or jaccl-ring (its device file), nccl (its rendezvous), else ring."""
    if envs.is_set("MLX_IBV_DEVICES") or envs.is_set("MLX_JACCL_COORDINATOR"):
        return "jaccl-ring" if envs.get("MLX_JACCL_RING") else "jaccl"
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


def nccl_rendezvous(comm) -> Tuple[str, int]:
    """Where NCCL's ranks meet, the same on every rank: rank 0's address
    (``NCCL_HOST_IP`` if set there, else the one rank 1 reaches it at,
    ``coordinator_address``: 127.0.0.1 when they share a host) and
    a port free on rank 0 now (``NCCL_PORT`` if set there), so that two jobs
    on one host do not collide."""
    address = coordinator_address(comm)
    host, port = comm_allgather_json(comm, [envs.get("NCCL_HOST_IP"), envs.get("NCCL_PORT") or free_port()])[0]
    return host or address, int(port)
