"""Only rank 0 runs the dense model; the other ranks hold experts and
nothing else.

For each MoE layer rank 0 reads the routing back to the host, posts a
non-blocking send of each owner's (row, local expert) batch (every send
before any wait), runs its own experts meanwhile, then receives each reply
and puts every slot back in its (row, k) place. Workers loop in ``serve``.
A token routed to several experts of one rank travels to it once, with the
list of its local experts. The exchange uses mpi4py on host buffers: MLX has
no non-blocking send, and its NCCL backend no send at all.
"""

import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..mpi import World
from ..watchdog import ACTIVITY
from . import wire
from .base import ExpertBatch, run_experts
from .ownership import LayerOwnership
from .stats import ExchangeStats


@dataclass
class P2PHandle:
    out_shape: Tuple[int, ...]  # [.., K, D]
    dtype: mx.Dtype
    local_slots: np.ndarray  # [s0] flat slots rank 0 computes itself
    replies: List[Tuple[np.ndarray, np.ndarray]] = field(default_factory=list)  # (slots, [s, D] buffer)
    requests: List[Any] = field(default_factory=list)  # [send, recv] per peer
    peers: List[int] = field(default_factory=list)  # ranks whose replies are awaited


class P2PDispatcher:
    name = "p2p"

    def __init__(self, world: World):
        self.world = world
        self.stats = ExchangeStats()

    def dispatch(self, ownership: LayerOwnership, x: mx.array, inds: mx.array):
        self.stats.layers += 1
        D, K = x.shape[-1], inds.shape[-1]
        mx.eval(x, inds)
        xs = x.reshape(-1, D)  # [.., D] -> [T, D]
        flat = np.asarray(inds).reshape(-1)  # [.., K] -> [S]
        self.stats.count(ownership.layer, flat, ownership.num_experts)
        owner = ownership.owner[flat]  # [S]
        local = ownership.local_index[flat]  # [S]
        x_np = wire.to_numpy(xs)  # [T, D]
        handle = P2PHandle(inds.shape + (D,), x.dtype, np.flatnonzero(owner == 0))
        comm = self.world.comm
        for rank in range(1, self.world.size):
            slots = np.flatnonzero(owner == rank)
            if slots.size == 0:
                continue
            rows, slot_rows = np.unique(slots // K, return_inverse=True)  # each token once per rank
            msg = wire.pack(wire.OP_EXPERTS, ownership.layer, x.dtype, local[slots], slot_rows, x_np[rows], ACTIVITY.step,
                            flat.size)
            handle.requests.append(comm.Isend(msg, dest=rank, tag=wire.TAG_EXPERTS))
            reply = np.empty((slots.size, D), dtype=x_np.dtype)
            handle.requests.append(comm.Irecv(reply, source=rank, tag=wire.TAG_RESULT))
            handle.replies.append((slots, reply))
            handle.peers.append(rank)
            self.stats.bytes_sent += msg.nbytes
            self.stats.rows_sent += rows.size
            self.stats.bytes_received += reply.nbytes
        self.stats.slots_local += handle.local_slots.size
        self.stats.slots_remote += flat.size - handle.local_slots.size
        if handle.local_slots.size == 0:
            return None, handle
        rows = mx.array(handle.local_slots // K)
        batch = ExpertBatch(xs[rows], mx.array(local[handle.local_slots])[:, None], flat.size)  # [s0, D], [s0, 1]
        return batch, handle

    def combine(self, y: Optional[mx.array], handle: P2PHandle) -> mx.array:
        from mpi4py import MPI

        D = handle.out_shape[-1]
        out = np.empty((int(np.prod(handle.out_shape[:-1])), D), dtype=wire.NUMPY_DTYPES[handle.dtype])  # [S, D]
        if y is not None:
            tic = time.perf_counter()
            out[handle.local_slots] = wire.to_numpy(y.reshape(-1, D))  # [s0, 1, D] -> [s0, D]
            self.stats.compute_seconds += time.perf_counter() - tic
        tic = time.perf_counter()
        # Wait for replies as they come, so a stall names the ranks still owing one.
        owing = dict(enumerate(handle.peers))
        while owing:
            ACTIVITY.beat("exchange", ACTIVITY.layer, sorted(owing.values()))
            for i in MPI.Request.Waitsome(handle.requests) or []:
                if i % 2 == 1:
                    owing.pop(i // 2, None)
        MPI.Request.Waitall(handle.requests)
        ACTIVITY.progress()
        self.stats.wait_seconds += time.perf_counter() - tic
        for slots, reply in handle.replies:
            out[slots] = reply
        return wire.from_numpy(out, handle.dtype).reshape(handle.out_shape)  # [S, D] -> [.., K, D]

    def progress_after_combine(self, layer: int) -> Tuple[str, Optional[int]]:
        return ("dense", layer)  # the exchange has completed

    def finish(self) -> None:
        """Release the workers from ``serve`` (end of a generation)."""
        for rank in range(1, self.world.size):
            self.world.comm.Send(wire.done_message(), dest=rank, tag=wire.TAG_EXPERTS)

    def serve(self, experts: Dict[int, nn.Module], ownership: Dict[int, LayerOwnership], on_layer=None) -> None:
        """A worker's part in one generation: run the owned experts on each
        batch rank 0 sends, until it says DONE. ``on_layer(layer, step)`` runs
        before each batch (the test-only fault injection)."""
        from mpi4py import MPI

        comm, status, stats = self.world.comm, MPI.Status(), self.stats
        while True:
            ACTIVITY.beat("serving")
            comm.Probe(source=0, tag=wire.TAG_EXPERTS, status=status)
            buf = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)
            comm.Recv(buf, source=0, tag=wire.TAG_EXPERTS)
            msg = wire.unpack(buf)
            if msg.op == wire.OP_DONE:
                return
            ACTIVITY.step = msg.step
            ACTIVITY.prefill = False  # one layer's experts at a time: the plain deadline
            ACTIVITY.beat("experts", msg.layer)
            if on_layer is not None:
                on_layer(msg.layer, msg.step)
            tic = time.perf_counter()
            rows = msg.local_ids.size
            x = msg.x[mx.array(msg.slot_rows)]  # [u, D] -> [s, D]
            batch = ExpertBatch(x, mx.array(msg.local_ids)[:, None], msg.total_slots)  # [s, D], [s, 1]
            y = run_experts(experts[msg.layer], batch)  # [s, 1, D]
            reply = wire.to_numpy(y.reshape(rows, -1))
            stats.compute_seconds += time.perf_counter() - tic
            comm.Send(reply, dest=0, tag=wire.TAG_RESULT)
            ACTIVITY.progress()
            stats.layers += 1
            stats.slots_local += rows
            stats.bytes_received += buf.nbytes
            stats.bytes_sent += reply.nbytes
            layer = ownership[msg.layer]
            stats.count(msg.layer, layer.owned_experts[msg.local_ids], layer.num_experts)
