"""Probes for ``mlxdist.bench``: a profiling pass and the transport's floor.

Both need every rank to act at the same moment, so they travel as an extra
``bench`` argument of the STATS command (``install`` wraps ``Server.stats``
on every rank before ``mlxdist.init()``; without that argument STATS is
unchanged). Nothing here edits the runtime's own modules.

Profiling pass (``profile``): ``DistributedSwitch.__call__`` is wrapped with a
version that evaluates at each boundary, so each decode-step MoE layer splits
into

    rest      evaluating the layer's input (attention, router, everything
              since the previous MoE layer) and what is left of the step
    expert    this rank's experts on its slots (``mx.eval`` of y)
    exchange  dispatch + combine (p2p: packing, sends, the wait, unpacking;
              collective: masking and ``all_sum``, including waiting for the
              slowest rank)

The syncs serialise what the timed pass overlaps, so the profiled step is
slower: the breakdown is a separate pass and never feeds the tok/s numbers.

Floor (``floor``): the bare transport the dispatch uses, on the same bytes as
a decode-step layer: ``mx.distributed.all_sum`` of the [.., K, D] slots
(collective), or rank 0 posting mpi4py ``Isend``/``Irecv`` of each worker's
batch while workers ``Recv`` and ``Send`` back (p2p).
"""

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Dict, List

import mlx.core as mx
import numpy as np

from .moe import DistributedSwitch
from .mpi import World, allgather_json, barrier
from .server import Server

_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


@dataclass
class Profile:
    """Decode-step MoE layer calls on one rank and where their time went."""

    calls: int = 0
    expert_seconds: float = 0.0
    exchange_seconds: float = 0.0
    input_seconds: float = 0.0
    slots_shape: tuple = ()
    dtype: str = ""
    bytes_sent: int = 0
    bytes_received: int = 0


_STATE: Dict[str, Any] = {"on": False, "profile": Profile()}
_ORIGINAL_CALL = DistributedSwitch.__call__
_ORIGINAL_STATS = Server.stats


def _profiled_call(self: DistributedSwitch, x: mx.array, inds: mx.array) -> mx.array:
    if not _STATE["on"]:
        return _ORIGINAL_CALL(self, x, inds)
    decode = x.ndim >= 2 and x.shape[-2] == 1
    stats = self.dispatcher.stats
    sent, received = stats.bytes_sent, stats.bytes_received
    t0 = time.perf_counter()
    mx.eval(x, inds)
    t1 = time.perf_counter()
    batch, handle = self.dispatcher.dispatch(self.shard, x, inds)
    t2 = time.perf_counter()
    y = None
    if batch is not None and self.experts is not None:
        y = self.experts(batch.x, batch.inds)
        mx.eval(y)
    t3 = time.perf_counter()
    out = self.dispatcher.combine(y, handle)
    mx.eval(out)
    t4 = time.perf_counter()
    if decode:
        p = _STATE["profile"]
        p.calls += 1
        p.input_seconds += t1 - t0
        p.expert_seconds += t3 - t2
        p.exchange_seconds += (t2 - t1) + (t4 - t3)
        p.slots_shape = tuple(inds.shape) + (x.shape[-1],)
        p.dtype = str(x.dtype).split(".")[-1]
        p.bytes_sent += stats.bytes_sent - sent
        p.bytes_received += stats.bytes_received - received
    return out


def _stats(self: Server, args: Dict[str, Any]) -> List[Dict[str, Any]]:
    probe = args.get("bench")
    if probe is None:
        return _ORIGINAL_STATS(self, args)
    return allgather_json(self.world, _run_probe(self, probe))


def install() -> None:
    """Wrap the expert module and the STATS handler (every rank, before
    ``mlxdist.init()``). Inert until a ``bench`` STATS command arrives."""
    DistributedSwitch.__call__ = _profiled_call
    Server.stats = _stats


def _run_probe(server: Server, probe: Dict[str, Any]) -> Dict[str, Any]:
    op = probe["op"]
    engine = server.engine
    if op == "no_eos":  # as mlx_lm.benchmark: never stop early
        if engine is not None and engine.tokenizer is not None:
            engine.tokenizer._eos_token_ids = set()
        return {}
    if op == "profile":
        _STATE["on"] = bool(probe["on"])
        if _STATE["on"]:
            _STATE["profile"] = Profile()
        return asdict(_STATE["profile"])
    if op == "floor":
        return {"seconds": measure_floor(server.world, **probe["args"])}
    raise ValueError(f"unknown bench probe {op!r}")


def probe(cluster, op: str, **kw) -> List[Dict[str, Any]]:
    """Run one probe on every rank (rank 0 only); returns each rank's answer."""
    from . import commands

    command = cluster._broadcast(commands.Command(commands.STATS, {"bench": {"op": op, **kw}}))
    return cluster.server.stats(command.args)


def measure_floor(
    world: World,
    mode: str,
    shape: List[int],
    dtype: str,
    send_bytes: int = 0,
    recv_bytes: int = 0,
    iters: int = 50,
) -> float:
    """Median seconds of one bare exchange of a decode-step layer's bytes
    (0.0 with one rank). Every rank must call it with the same arguments."""
    if world.size == 1:
        return 0.0
    if mode == "collective":
        step = _all_sum_step(world, shape, dtype)
    else:
        step = _p2p_step(world, send_bytes, recv_bytes)
    for _ in range(5):
        step()
    times = []
    barrier(world)
    for _ in range(iters):
        tic = time.perf_counter()
        step()
        times.append(time.perf_counter() - tic)
    # Rank 0's view: the others' times are their part of the same exchanges.
    return statistics.median(times)


def _all_sum_step(world: World, shape: List[int], dtype: str):
    a = mx.ones(tuple(shape), dtype=_DTYPES[dtype])
    mx.eval(a)

    def step():
        mx.eval(mx.distributed.all_sum(a, group=world.group))

    return step


def _p2p_step(world: World, send_bytes: int, recv_bytes: int):
    """One round trip shaped like the p2p dispatch: rank 0 posts every send
    and receive, then waits; each worker receives its batch and answers."""
    from mpi4py import MPI

    comm, workers = world.comm, world.size - 1
    per_send = max(send_bytes // workers, 1)
    per_recv = max(recv_bytes // workers, 1)
    out = np.zeros(per_send, dtype=np.uint8)
    back = [np.empty(per_recv, dtype=np.uint8) for _ in range(workers)]
    got = np.empty(per_send, dtype=np.uint8)
    answer = np.zeros(per_recv, dtype=np.uint8)

    def step():
        if world.is_root:
            requests = []
            for r in range(1, world.size):
                requests.append(comm.Isend(out, dest=r, tag=91))
                requests.append(comm.Irecv(back[r - 1], source=r, tag=92))
            MPI.Request.Waitall(requests)
        else:
            comm.Recv(got, source=0, tag=91)
            comm.Send(answer, dest=0, tag=92)

    return step
