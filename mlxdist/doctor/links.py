"""Between every pair of ranks: the address each reaches the other at, a TCP
connection to it, and latency and bandwidth over the backend in use.

Addresses come from ``runtime/addresses.py``, as the ring, JACCL and NCCL
starts choose them: a loopback address toward a rank on another host is a
problem (``MLXDIST_RING_INTERFACE=lo`` gives one). Each rank listens on its
address toward each peer and every peer connects to it (a firewall or a
missing route shows here, before a backend waits on it forever).

Timing: a ping-pong of MLX ``send``/``recv`` between the two ranks of each
pair (the others wait), small (8 bytes: latency, half the round trip) and
large (``LARGE`` bytes: bandwidth one way). MLX's ring sends to neighbours
only, so over ring only neighbouring pairs are timed; NCCL has no send on
MLX, so there an ``all_sum`` of the whole group is timed instead.

Every gather goes through ``together.gathered``: a probe that fails on one
rank fails the step on all of them at once.
"""

import socket
import time
from typing import Any, Dict, List, Optional

from mlxdist import envs
from mlxdist.doctor.together import gathered
from mlxdist.errors import StepFailed
from mlxdist.runtime.addresses import address_toward, describe_host, same_host
from mlxdist.runtime.agreement import failed_together

SMALL, LARGE = 8, 4 << 20
REPEATS = {SMALL: 20, LARGE: 3}
CONNECT_SECONDS = 3


def addresses(world) -> List[Dict[str, Any]]:
    """Every rank's host description and its address toward each rank
    (None where none is found: the reason is in ``errors``)."""
    hosts = gathered(world, "could not describe its host", describe_host)
    return gathered(world, "could not find its addresses", lambda: _toward(world.rank, hosts))


def _toward(rank: int, hosts: List[Dict[str, Any]]) -> Dict[str, Any]:
    """This rank's host and its address toward each rank's host."""
    me = hosts[rank]
    toward, errors = [], {}
    for j, peer in enumerate(hosts):
        try:
            toward.append(None if j == rank else address_toward(me, peer, envs.get("MLXDIST_RING_INTERFACE")))
        except RuntimeError as e:
            toward.append(None)
            errors[str(j)] = str(e)
    return {"host": me, "toward": toward, "errors": errors}


def reachability(world, table: List[Dict[str, Any]]) -> List[List[Optional[bool]]]:
    """``[i][j]``: whether rank i connected to rank j at j's address toward i."""
    listeners: List[socket.socket] = []
    try:
        ports = gathered(world, "could not listen", lambda: _listen(table[world.rank]["toward"], listeners))
        return gathered(world, "could not test its connections", lambda: _connect(world.rank, table, ports))
    finally:
        for s in listeners:
            s.close()


def _listen(toward: List[Optional[str]], listeners: List[socket.socket]) -> List[Optional[int]]:
    """A port listening at each address in ``toward`` (None where there is
    none or it cannot be bound); the sockets are added to ``listeners``."""
    mine = []
    for address in toward:
        if address is None:
            mine.append(None)
            continue
        s = socket.socket()
        try:
            s.bind((address, 0))
            s.listen(16)
        except OSError:
            s.close()
            mine.append(None)
            continue
        listeners.append(s)
        mine.append(s.getsockname()[1])
    return mine


def _connect(rank: int, table: List[Dict[str, Any]], ports: List[List[Optional[int]]]) -> List[Optional[bool]]:
    """Whether this rank connects to each rank at its address and port toward this one."""
    row = []
    for j in range(len(table)):
        address, port = table[j]["toward"][rank], ports[j][rank]
        if j == rank:
            row.append(None)
            continue
        try:
            with socket.create_connection((address, port), timeout=CONNECT_SECONDS):
                row.append(True)
        except (OSError, TypeError):
            row.append(False)
    return row


def _pairs(world) -> List[tuple]:
    n = world.size
    if world.backend == "ring":
        return sorted({tuple(sorted((i, (i + 1) % n))) for i in range(n) if n > 1})
    return [(i, j) for i in range(n) for j in range(i + 1, n)]


def _pingpong(world, peer: int, first: bool, nbytes: int) -> float:
    """Seconds per one-way trip of ``nbytes`` between this rank and ``peer``."""
    import mlx.core as mx

    x = mx.zeros((max(nbytes // 4, 1),), dtype=mx.float32)
    group, repeats = world.group, REPEATS[nbytes]
    start = 0.0
    for k in range(repeats + 1):  # the first round connects and warms up
        if k == 1:
            start = time.perf_counter()
        if first:
            mx.eval(mx.distributed.send(x, peer, group=group))
            mx.eval(mx.distributed.recv_like(x, peer, group=group))
        else:
            y = mx.distributed.recv_like(x, peer, group=group)
            mx.eval(y)
            mx.eval(mx.distributed.send(y, peer, group=group))
    return (time.perf_counter() - start) / repeats / 2


def timings(world) -> Dict[str, Any]:
    """Latency (seconds, small messages) and bandwidth (bytes/s, large) per
    timed pair, as ``{"pairs": [[i, j, latency, bandwidth], ...]}``, or the
    group's ``all_sum`` time where MLX has no send (nccl)."""
    if world.size == 1:
        return {"pairs": []}
    if world.backend == "nccl":
        try:
            return {"pairs": [], "all_sum_seconds": _all_sum_seconds(world)}
        except Exception as e:  # noqa: BLE001 - the others may be inside the all_sum: ended together or by this rank
            raise StepFailed(f"could not time the link: {failed_together(world, e)}") from None
    rows = []
    for i, j in _pairs(world):
        gathered(world, "could not time its links", lambda: None)  # the pair starts once every rank is here
        if world.rank in (i, j):
            peer = j if world.rank == i else i
            try:
                latency = _pingpong(world, peer, world.rank == i, SMALL)
                bandwidth = LARGE / _pingpong(world, peer, world.rank == i, LARGE)
            except Exception as e:  # noqa: BLE001 - the peer is inside MLX's send or receive: end the job
                raise StepFailed(f"could not time its link to rank {peer}: {failed_together(world, e)}") from None
            if world.rank == i:  # the pair's first rank reports it
                rows.append([i, j, latency, bandwidth])
    return {"pairs": sorted(r for part in gathered(world, "could not time its links", lambda: rows) for r in part)}


def _all_sum_seconds(world) -> float:
    """Seconds per ``all_sum`` of SMALL bytes over the group."""
    import mlx.core as mx

    x = mx.zeros((SMALL // 4,))
    mx.eval(mx.distributed.all_sum(x, group=world.group))
    start = time.perf_counter()
    for _ in range(REPEATS[SMALL]):
        mx.eval(mx.distributed.all_sum(x, group=world.group))
    return (time.perf_counter() - start) / REPEATS[SMALL]


def hosts_differ(table: List[Dict[str, Any]], i: int, j: int) -> bool:
    return not same_host(table[i]["host"], table[j]["host"])
