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
"""

import socket
import time
from typing import Any, Dict, List, Optional

from mlxdist import envs
from mlxdist.runtime.addresses import address_toward, describe_host, same_host

SMALL, LARGE = 8, 4 << 20
REPEATS = {SMALL: 20, LARGE: 3}
CONNECT_SECONDS = 3


def addresses(world) -> List[Dict[str, Any]]:
    """Every rank's host description and its address toward each rank
    (None where none is found: the reason is in ``errors``)."""
    hosts = world.control.allgather_json(describe_host())
    me = hosts[world.rank]
    toward, errors = [], {}
    for j, peer in enumerate(hosts):
        try:
            toward.append(None if j == world.rank else address_toward(me, peer, envs.get("MLXDIST_RING_INTERFACE")))
        except RuntimeError as e:
            toward.append(None)
            errors[str(j)] = str(e)
    return world.control.allgather_json({"host": me, "toward": toward, "errors": errors})


def reachability(world, table: List[Dict[str, Any]]) -> List[List[Optional[bool]]]:
    """``[i][j]``: whether rank i connected to rank j at j's address toward i."""
    listeners, mine = [], []
    for j, address in enumerate(table[world.rank]["toward"]):
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
    ports = world.control.allgather_json(mine)
    row = []
    for j in range(len(table)):
        address, port = table[j]["toward"][world.rank], ports[j][world.rank]
        if j == world.rank:
            row.append(None)
            continue
        try:
            with socket.create_connection((address, port), timeout=CONNECT_SECONDS):
                row.append(True)
        except (OSError, TypeError):
            row.append(False)
    result = world.control.allgather_json(row)
    for s in listeners:
        s.close()
    return result


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
    import mlx.core as mx

    if world.size == 1:
        return {"pairs": []}
    if world.backend == "nccl":
        x = mx.zeros((SMALL // 4,))
        mx.eval(mx.distributed.all_sum(x, group=world.group))
        start = time.perf_counter()
        for _ in range(REPEATS[SMALL]):
            mx.eval(mx.distributed.all_sum(x, group=world.group))
        return {"pairs": [], "all_sum_seconds": (time.perf_counter() - start) / REPEATS[SMALL]}
    rows = []
    for i, j in _pairs(world):
        world.control.barrier()
        if world.rank in (i, j):
            peer = j if world.rank == i else i
            latency = _pingpong(world, peer, world.rank == i, SMALL)
            bandwidth = LARGE / _pingpong(world, peer, world.rank == i, LARGE)
            if world.rank == i:  # the pair's first rank reports it
                rows.append([i, j, latency, bandwidth])
    return {"pairs": sorted(r for part in world.control.allgather_json(rows) for r in part)}


def hosts_differ(table: List[Dict[str, Any]], i: int, j: int) -> bool:
    return not same_host(table[i]["host"], table[j]["host"])
