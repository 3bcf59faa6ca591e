"""Probes for the benchmark: a profiling pass and the transport's floor.

Both need every rank to act at the same moment, so they are registered
probes (``executor.register_probe``), run on every rank by
``Cluster.probe``. Importing this module registers them; every rank of a
``python -m mlxdist.bench`` job imports it.

Profiling pass (``profile``): an observer on every MoE layer
(``Engine.observe``) evaluates at each boundary, so each decode-step layer
splits into

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
(collective); the all_gather of each rank's [T, D + weights + ids] rows and
the reduce of the [N*T, D] partial sums (dp); or rank 0 posting mpi4py
``Isend``/``Irecv`` of each worker's batch while workers ``Recv`` and
``Send`` back (p2p).
"""

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Tuple

import mlx.core as mx
import numpy as np

from mlxdist.compat import never_stop_at_eos
from mlxdist.decide import traffic
from mlxdist.commands.executor import CommandExecutor, register_probe
from mlxdist.model.switch import DistributedSwitch
from mlxdist.runtime.world import World

_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


@dataclass
class Profile:
    """Decode-step MoE layer calls on one rank and where their time went."""

    calls: int = 0
    expert_seconds: float = 0.0
    exchange_seconds: float = 0.0
    input_seconds: float = 0.0
    slots_shape: Tuple[int, ...] = ()
    dtype: str = ""
    bytes_sent: int = 0
    bytes_received: int = 0
    _marks: Dict[str, float] = field(default_factory=dict, repr=False)
    _bytes: Tuple[int, int] = (0, 0)

    def __call__(self, switch: DistributedSwitch, boundary: str, arrays: Tuple[mx.array, ...]) -> None:
        """The layer observer: evaluate what is ready, note the time."""
        stats = switch.dispatcher.stats
        if boundary == "input":
            self._marks = {"start": time.perf_counter()}
            self._bytes = (stats.bytes_sent, stats.bytes_received)
            x = arrays[0]  # and the routing, except where whole blocks are exchanged: then the rows' shape
            shape = tuple(arrays[1].shape) + (x.shape[-1],) if len(arrays) > 1 else tuple(x.shape)
            self._shape, self._dtype = shape, str(x.dtype).split(".")[-1]
            self._decode = x.ndim >= 2 and x.shape[-2] == 1
        mx.eval(*arrays)
        self._marks[boundary] = time.perf_counter()
        if boundary != "combined" or not self._decode:
            return
        m = self._marks
        self.calls += 1
        self.input_seconds += m["input"] - m["start"]
        self.expert_seconds += m["experts"] - m["dispatched"]
        # Whole blocks: the rest of the block after the experts is not exchange.
        self.exchange_seconds += (m["dispatched"] - m["input"]) + (m["combined"] - m.get("block", m["experts"]))
        self.slots_shape, self.dtype = self._shape, self._dtype
        self.bytes_sent += stats.bytes_sent - self._bytes[0]
        self.bytes_received += stats.bytes_received - self._bytes[1]

    def as_dict(self) -> Dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if not k.startswith("_")}


_PROFILE = Profile()


@register_probe("no_eos")
def no_eos(executor: CommandExecutor, args: Dict[str, Any]) -> Dict[str, Any]:
    """As mlx_lm.benchmark: never stop early."""
    engine = executor.engine
    if engine is not None and engine.tokenizer is not None:
        never_stop_at_eos(engine.tokenizer)
    return {}


@register_probe("profile")
def profile(executor: CommandExecutor, args: Dict[str, Any]) -> Dict[str, Any]:
    """``on=True``: start a fresh profile of every MoE layer; ``on=False``:
    stop and return it."""
    global _PROFILE
    if args["on"]:
        _PROFILE = Profile()
    executor.engine.observe(_PROFILE if args["on"] else None)
    return _PROFILE.as_dict()


_LINKED = {name: getattr(mx.distributed, name) for name in ("all_gather", "all_sum", "sum_scatter")}
_LOCAL = {
    "all_gather": lambda x, group=None, stream=None: mx.concatenate([x] * group.size()),
    "all_sum": lambda x, group=None, stream=None: x * 1,
    "sum_scatter": lambda x, group=None, stream=None: x.reshape(group.size(), -1, *x.shape[1:])[0] * 1,
}


@register_probe("no_link")
def no_link(executor: CommandExecutor, args: Dict[str, Any]) -> Dict[str, Any]:
    """``on=True``: MLX's collectives become local stand-ins of the same
    shapes (one copy or elementwise kernel each), so each rank computes as if
    the link were free and the other ranks always ready: what a step costs
    without the exchange's transport and waiting. The tokens are not the
    model's. ``on=False``: the real collectives again."""
    for name, fn in (_LOCAL if args["on"] else _LINKED).items():
        setattr(mx.distributed, name, fn)
    return {}


@register_probe("floor")
def floor(executor: CommandExecutor, args: Dict[str, Any]) -> Dict[str, Any]:
    """The transport floor of one decode-step layer's bytes."""
    return {"seconds": measure_floor(executor.world, **args)}


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
    kind = traffic.exchange_kind(mode)
    if kind == "sendrecv":
        step = _p2p_step(world, send_bytes, recv_bytes)
    elif kind == "gather":
        step = _dp_step(world, int(np.prod(shape[:-2])), shape[-1], dtype, 2 * 4 * shape[-2])
    elif kind == "gather-rows":  # whole blocks: [.., D] rows, no routing on the wire
        step = _dp_step(world, int(np.prod(shape[:-1])), shape[-1], dtype, 0)
    else:  # collective: [.., K, D] slots; collective-width: [.., D] rows
        step = _all_sum_step(world, shape, dtype)
    for _ in range(5):
        step()
    times = []
    world.control.barrier()
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


def _dp_step(world: World, rows: int, d: int, dtype: str, routing_bytes: int):
    """One rank's ``rows``: gather them (D values and ``routing_bytes`` of
    expert ids and weights each), reduce the partials."""
    dt = _DTYPES[dtype]
    packed = mx.ones((rows, d + routing_bytes // dt.size), dtype=dt)
    partial = mx.ones((world.size * rows, d), dtype=dt)
    mx.eval(packed, partial)

    def step():
        gathered = mx.distributed.all_gather(packed, group=world.group)
        if world.backend == "nccl":
            mx.eval(gathered, mx.distributed.sum_scatter(mx.depends(partial, gathered), group=world.group))
        else:
            mx.eval(gathered, mx.distributed.all_sum(mx.depends(partial, gathered), group=world.group))

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
