"""Moving (row, expert) slots to the ranks that own the experts, and back.

Notation: T tokens (rows) in the layer's input, K experts per token, D model
width, S = T * K slots, E experts in the layer.

    DistributedSwitch(x [.., D], inds [.., K])
      batch, handle = dispatcher.dispatch(shard, x, inds)   # who computes what
      y_local       = experts(batch.x, batch.inds)          # this rank's experts
      y             = dispatcher.combine(y_local, handle)   # [.., K, D], every slot

Two transports, one interface, chosen by name in ``make_dispatcher``:

- ``collective``: every rank holds the whole input. Each rank runs its experts
  on every slot (slots of experts it does not own are pointed at an expert it
  does own, so shapes never depend on the routing), zeroes the slots it does
  not own, and one ``all_sum`` per layer adds the disjoint slots. x + 0 == x,
  so the result is bit-identical to one process, and the graph stays lazy.
  With MLXDIST_COMPACT=1 (for the CPU, where reading the routing back costs
  little) each rank instead computes only its owned slots and scatters them
  into zeros ("compact").
- ``p2p``: only rank 0 runs the dense model. It reads the routing back to the
  host, posts a non-blocking send of each owner's (row, expert) batch, runs
  its own experts meanwhile, then puts each returned slot back in place.
  Workers hold experts and nothing else (``serve_experts``).

``collective-tp`` is ``collective`` without its all_sum, for a model whose
attention and dense layers mlx-lm's ``shard()`` split over the ranks: the
MoE block's own tensor-parallel all_sum then adds the partial slots (and the
shared experts). Faster where attention dominates; not bit-exact.

With one rank every mode is an identity: the expert module sees the input as is.
"""

import os
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx
import numpy as np

from .mpi import World
from .watchdog import ACTIVITY, inject

TAG_EXPERTS = 17
TAG_RESULT = 18
OP_EXPERTS = 1
OP_DONE = 2
_HEADER = 6  # int32: op, layer, dtype code, count, D, step

_WIRE_DTYPES = [mx.float32, mx.float16, mx.bfloat16]
_NP_DTYPES = {mx.float32: np.float32, mx.float16: np.float16, mx.bfloat16: np.uint16}


def to_numpy(a: mx.array) -> np.ndarray:
    """The array's bits as numpy (bfloat16 travels as uint16)."""
    return np.asarray(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)


def from_numpy(a: np.ndarray, dtype: mx.Dtype) -> mx.array:
    out = mx.array(a)
    return out.view(dtype) if dtype == mx.bfloat16 else out


@dataclass(frozen=True)
class ExpertShard:
    """One MoE layer as one rank sees it."""

    layer: int
    owner: np.ndarray  # [E] rank owning each expert
    local_index: np.ndarray  # [E] position of each expert in its owner's stack
    rank: int
    owned_ids: np.ndarray  # [e] global ids of this rank's experts, in stack order

    @property
    def owned(self) -> List[int]:
        return self.owned_ids.tolist()

    @classmethod
    def build(cls, layer: int, owners: List[int], rank: int) -> "ExpertShard":
        owner = np.asarray(owners, dtype=np.int32)
        local_index = np.zeros(len(owners), dtype=np.int32)
        for r in np.unique(owner):
            held = np.flatnonzero(owner == r)
            local_index[held] = np.arange(held.size, dtype=np.int32)
        return cls(layer, owner, local_index, rank, np.flatnonzero(owner == rank))


@dataclass
class ExpertBatch:
    x: mx.array  # [.., D]
    inds: mx.array  # [.., k] local expert ids


@dataclass
class ExchangeStats:
    """Counters a dispatcher keeps: what moved, and how long rank 0 waited."""

    layers: int = 0
    slots_local: int = 0
    slots_remote: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    wait_seconds: float = 0.0
    compute_seconds: float = 0.0
    expert_load: Dict[int, Any] = field(default_factory=dict)  # layer -> [E] routed slots

    def count(self, layer: int, inds, num_experts: int) -> Any:
        """Add this call's routed slots per expert; returns the running total
        (an MLX array in the lazy path, so it is evaluated with the step)."""
        total = self.expert_load.get(layer)
        if isinstance(inds, np.ndarray):
            counts = np.bincount(inds, minlength=num_experts)
        else:
            counts = mx.zeros((num_experts,), dtype=mx.int32).at[inds.reshape(-1)].add(1)
        self.expert_load[layer] = counts if total is None else total + counts
        return self.expert_load[layer]

    def as_dict(self) -> Dict[str, Any]:
        out = dict(self.__dict__)
        out["expert_load"] = {str(l): np.asarray(c).tolist() for l, c in self.expert_load.items()}
        return out

    def reset(self) -> None:
        self.__init__()


@dataclass(frozen=True)
class CollectiveHandle:
    owned: Optional[mx.array]  # [.., K] bool: slots this rank computed (masked layout)
    out_shape: Tuple[int, ...]  # [.., K, D]
    dtype: mx.Dtype
    load: mx.array  # [E] running count of routed slots per expert
    slots: Optional[mx.array] = None  # [s] flat slots this rank computed (compact layout)


class CollectiveDispatcher:
    name = "collective"

    def __init__(self, world: World, compact: bool = False, reduce: bool = True):
        self.world = world
        self.compact = compact
        # reduce=False: return this rank's partial slots; the model's own
        # tensor-parallel MoE block sums them (with its shared experts) itself.
        self.reduce = reduce
        self.stats = ExchangeStats()
        self._tables: Dict[int, Tuple[mx.array, mx.array]] = {}

    def _table(self, shard: ExpertShard) -> Tuple[mx.array, mx.array]:
        if shard.layer not in self._tables:
            owned = shard.owner == shard.rank
            # Slots of experts held elsewhere are pointed at local expert 0:
            # computed, then zeroed, so shapes never depend on the routing.
            self._tables[shard.layer] = (
                mx.array(np.where(owned, shard.local_index, 0)),
                mx.array(owned),
            )
        return self._tables[shard.layer]

    def dispatch(self, shard: ExpertShard, x: mx.array, inds: mx.array):
        load = self.stats.count(shard.layer, inds, shard.owner.size)
        self.stats.layers += 1
        if self.world.size == 1:
            return ExpertBatch(x, inds), CollectiveHandle(None, (), x.dtype, load)
        if self.compact:
            return self._dispatch_compact(shard, x, inds, load)
        local_index, owned = self._table(shard)
        handle = CollectiveHandle(owned[inds], inds.shape + x.shape[-1:], x.dtype, load)
        return ExpertBatch(x, local_index[inds]), handle

    def _dispatch_compact(self, shard: ExpertShard, x: mx.array, inds: mx.array, load: mx.array):
        # Where a host read-back is cheap (the CPU), compute owned slots only
        # instead of every slot masked: the same exact result, 1/N the work.
        D, K = x.shape[-1], inds.shape[-1]
        mx.eval(inds)
        flat = np.asarray(inds).reshape(-1)  # [.., K] -> [S]
        mine = np.flatnonzero(shard.owner[flat] == shard.rank)  # [s]
        handle = CollectiveHandle(None, inds.shape + (D,), x.dtype, load, mx.array(mine))
        if mine.size == 0:
            return None, handle
        rows = mx.array(mine // K)
        batch = ExpertBatch(x.reshape(-1, D)[rows], mx.array(shard.local_index[flat[mine]])[:, None])
        return batch, handle  # [s, D], [s, 1]

    def combine(self, y: Optional[mx.array], handle: CollectiveHandle):
        if handle.slots is not None:  # compact: put each computed slot in place
            D = handle.out_shape[-1]
            out = mx.zeros((int(np.prod(handle.out_shape[:-1])), D), dtype=handle.dtype)  # [S, D]
            if y is not None:
                out = out.at[handle.slots].add(y.reshape(-1, D))  # [s, 1, D] -> [s, D]
            y = out.reshape(handle.out_shape)
        elif handle.owned is not None:
            if y is None:  # this rank owns no expert of the layer
                y = mx.zeros(handle.out_shape, dtype=handle.dtype)
            else:
                y = mx.where(handle.owned[..., None], y, mx.array(0, dtype=y.dtype))
        if handle.out_shape and self.reduce:
            self.stats.bytes_sent += y.nbytes
            y = mx.distributed.all_sum(y, group=self.world.group)
        # Evaluating y now also evaluates the load counters (no growing graph).
        return mx.depends(y, handle.load)

    def after_combine(self, layer: int):
        # The graph is only built here; it runs (and may block in all_sum) later.
        return ("exchange", None)

    def finish(self) -> None:
        pass


@dataclass
class P2PHandle:
    out_shape: Tuple[int, ...]  # [.., K, D]
    dtype: mx.Dtype
    mine: np.ndarray  # [s0] slots rank 0 computes
    pending: List[Tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    requests: List[Any] = field(default_factory=list)
    peers: List[int] = field(default_factory=list)  # ranks whose replies are awaited


def _pack(op: int, layer: int, dtype: mx.Dtype, idx: np.ndarray, x: np.ndarray, step: int = 0) -> np.ndarray:
    count, d = x.shape if x.ndim == 2 else (0, 0)
    header = np.array([op, layer, _WIRE_DTYPES.index(dtype), count, d, step], dtype=np.int32)
    return np.concatenate(
        [header.view(np.uint8), idx.astype(np.int32).view(np.uint8), x.reshape(-1).view(np.uint8)]
    )


class P2PDispatcher:
    name = "p2p"

    def __init__(self, world: World):
        self.world = world
        self.stats = ExchangeStats()

    def dispatch(self, shard: ExpertShard, x: mx.array, inds: mx.array):
        if self.world.size == 1:
            self.stats.layers += 1
            self.stats.count(shard.layer, inds, shard.owner.size)
            return ExpertBatch(x, inds), None
        D, K = x.shape[-1], inds.shape[-1]
        mx.eval(x, inds)
        xs = x.reshape(-1, D)  # [.., D] -> [T, D]
        flat = np.asarray(inds).reshape(-1)  # [.., K] -> [S]
        self.stats.count(shard.layer, flat, shard.owner.size)
        owner = shard.owner[flat]  # [S]
        local = shard.local_index[flat]  # [S]
        x_np = to_numpy(xs)  # [T, D]
        handle = P2PHandle(inds.shape + (D,), x.dtype, np.flatnonzero(owner == 0))
        comm = self.world.comm
        for rank in range(1, self.world.size):
            slots = np.flatnonzero(owner == rank)
            if slots.size == 0:
                continue
            msg = _pack(OP_EXPERTS, shard.layer, x.dtype, local[slots], x_np[slots // K], ACTIVITY.step)
            handle.requests.append(comm.Isend(msg, dest=rank, tag=TAG_EXPERTS))
            out = np.empty((slots.size, D), dtype=x_np.dtype)
            handle.requests.append(comm.Irecv(out, source=rank, tag=TAG_RESULT))
            handle.pending.append((slots, out))
            handle.peers.append(rank)
            self.stats.bytes_sent += msg.nbytes
            self.stats.bytes_received += out.nbytes
        self.stats.layers += 1
        self.stats.slots_local += handle.mine.size
        self.stats.slots_remote += flat.size - handle.mine.size
        if handle.mine.size == 0:
            return None, handle
        rows = mx.array(handle.mine // K)
        batch = ExpertBatch(xs[rows], mx.array(local[handle.mine])[:, None])  # [s0, D], [s0, 1]
        return batch, handle

    def combine(self, y: Optional[mx.array], handle: Optional[P2PHandle]):
        if handle is None:
            return y
        D = handle.out_shape[-1]
        out = np.empty((int(np.prod(handle.out_shape[:-1])), D), dtype=_NP_DTYPES[handle.dtype])
        if y is not None:
            tic = time.perf_counter()
            out[handle.mine] = to_numpy(y.reshape(-1, D))  # [s0, 1, D] -> [s0, D]
            self.stats.compute_seconds += time.perf_counter() - tic
        tic = time.perf_counter()
        from mpi4py import MPI

        # Wait for replies as they come, so a stall names the ranks still owing one.
        owing = {i: rank for i, rank in enumerate(handle.peers)}
        requests = handle.requests
        while owing:
            ACTIVITY.beat("exchange", ACTIVITY.layer, sorted(owing.values()))
            for i in MPI.Request.Waitsome(requests) or []:
                if i % 2 == 1:  # [send, recv] per peer
                    owing.pop(i // 2, None)
        MPI.Request.Waitall(requests)
        self.stats.wait_seconds += time.perf_counter() - tic
        for slots, result in handle.pending:
            out[slots] = result
        return from_numpy(out, handle.dtype).reshape(handle.out_shape)  # [S, D] -> [.., K, D]

    def after_combine(self, layer: int):
        return ("dense", layer)

    def finish(self) -> None:
        """Release the workers from ``serve_experts`` (end of a generation)."""
        for rank in range(1, self.world.size):
            msg = _pack(OP_DONE, -1, mx.float32, np.zeros(0, np.int32), np.zeros((0, 0), np.float32))
            self.world.comm.Send(msg, dest=rank, tag=TAG_EXPERTS)


def serve_experts(
    world: World, experts: Dict[int, Any], shards: Dict[int, ExpertShard], stats: ExchangeStats
) -> None:
    """A p2p worker's loop: run the owned experts on each batch rank 0 sends
    until it says DONE."""
    from mpi4py import MPI

    comm, status = world.comm, MPI.Status()
    while True:
        ACTIVITY.beat("serving")
        comm.Probe(source=0, tag=TAG_EXPERTS, status=status)
        msg = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)
        comm.Recv(msg, source=0, tag=TAG_EXPERTS)
        op, layer, code, count, D, step = map(int, msg[: 4 * _HEADER].view(np.int32))
        if op == OP_DONE:
            return
        ACTIVITY.step = step
        ACTIVITY.beat("experts", layer)
        inject(layer, step)
        dtype = _WIRE_DTYPES[code]
        idx_end = 4 * _HEADER + 4 * count
        local = msg[4 * _HEADER : idx_end].view(np.int32)
        x = from_numpy(msg[idx_end:].view(_NP_DTYPES[dtype]).reshape(count, D), dtype)
        tic = time.perf_counter()
        y = experts[layer](x, mx.array(local)[:, None])  # [s, D], [s, 1] -> [s, 1, D]
        out = to_numpy(y.reshape(count, D))
        stats.compute_seconds += time.perf_counter() - tic
        comm.Send(out, dest=0, tag=TAG_RESULT)
        stats.layers += 1
        stats.slots_local += count
        stats.bytes_received += msg.nbytes
        stats.bytes_sent += out.nbytes
        shard = shards[layer]
        stats.count(layer, shard.owned_ids[local], shard.owner.size)


DISPATCHERS = {"collective": CollectiveDispatcher, "p2p": P2PDispatcher, "collective-tp": CollectiveDispatcher}


def compact_by_default() -> bool:
    """Masked static shapes unless MLXDIST_COMPACT=1 asks for compact slots
    (owned slots only: faster on the CPU, where a host read-back costs
    little). Compact is opt-in: one 200-call soak run on the CPU crashed
    inside MLX with it (not yet understood; see the README)."""
    return os.environ.get("MLXDIST_COMPACT") == "1"


def make_dispatcher(name: str, world: World):
    """The one place a transport is chosen by name."""
    if name not in DISPATCHERS:
        raise ValueError(f"unknown dispatch mode {name!r} (choose {', '.join(DISPATCHERS)})")
    if name == "collective":
        return CollectiveDispatcher(world, compact=compact_by_default())
    if name == "collective-tp":
        return CollectiveDispatcher(world, compact=compact_by_default(), reduce=world.size == 1)
    return DISPATCHERS[name](world)
