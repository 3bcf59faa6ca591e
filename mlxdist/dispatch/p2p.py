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
import numpy as np

from mlxdist.runtime import survival
from mlxdist.runtime.world import World
from mlxdist.runtime.watchdog import ACTIVITY
from mlxdist.dispatch import wire
from mlxdist.dispatch.base import Combine, DenseRanks, Dispatcher, ExpertBatch, ExpertFn, LayerHook
from mlxdist.dispatch.ownership import LayerOwnership
from mlxdist.dispatch.stats import ExchangeStats


@dataclass
class P2PHandle:
    ownership: LayerOwnership
    xs: mx.array  # [T, D] the layer's token rows
    flat: np.ndarray  # [S] expert of each slot
    owner: np.ndarray  # [S] rank computing each slot
    local: np.ndarray  # [S] the slot's expert's position in that rank's stack
    out_shape: Tuple[int, ...]  # [.., K, D]
    dtype: mx.Dtype
    local_slots: np.ndarray  # [s0] flat slots rank 0 computes itself
    replies: List[Tuple[np.ndarray, np.ndarray]] = field(default_factory=list)  # (slots, [s, D] buffer)
    requests: List[Any] = field(default_factory=list)  # [send, recv] per peer
    peers: List[int] = field(default_factory=list)  # ranks whose replies are awaited
    adopted: Dict[int, Tuple[np.ndarray, mx.array]] = field(default_factory=dict)  # lost rank -> its slots, computed here
    posted: bool = False


class P2PDispatcher(Dispatcher):
    name = "p2p"
    dense_ranks = DenseRanks.ROOT
    survives_rank_loss = True
    combines = Combine.SLOTS
    exact = True

    def __init__(self, world: World):
        self.world = world
        self.stats = ExchangeStats()
        self.generation = 0  # generations finished (numbers the DONE messages)
        self.adopted: Dict[int, ExpertFn] = {}  # lost rank -> its experts, now computed on rank 0

    def adopt(self, rank: int, experts: ExpertFn) -> None:
        self.adopted[rank] = experts

    def dispatch(self, ownership: LayerOwnership, x: mx.array, inds: mx.array, weights: Optional[mx.array] = None):
        self.stats.layers += 1
        D = x.shape[-1]
        mx.eval(x, inds)
        xs = x.reshape(-1, D)  # [.., D] -> [T, D]
        flat = np.asarray(inds).reshape(-1)  # [.., K] -> [S]
        self.stats.count(ownership.layer, flat, ownership.num_experts)
        self.stats.count_balance(ownership, flat)
        owner = ownership.slot_owners(flat)  # [S]
        local = ownership.slot_local(flat, owner)  # [S]
        handle = P2PHandle(ownership, xs, flat, owner, local, inds.shape + (D,), x.dtype, np.flatnonzero(owner == 0))
        self._post(handle)
        self.stats.slots_local += handle.local_slots.size
        self.stats.slots_remote += flat.size - handle.local_slots.size
        if handle.local_slots.size == 0:
            return None, handle
        return self._batch(handle, handle.local_slots), handle

    def _batch(self, handle: P2PHandle, slots: np.ndarray) -> ExpertBatch:
        """The rows and local expert ids of ``slots``, for whoever owns them."""
        K = handle.out_shape[-2]
        return ExpertBatch(handle.xs[mx.array(slots // K)], mx.array(handle.local[slots])[:, None], handle.flat.size)  # [s, D], [s, 1]

    def _post(self, handle: P2PHandle) -> None:
        """Send each live owner its (row, local expert) batch and post the
        receive of its reply; a lost owner's slots are computed here."""
        K, D = handle.out_shape[-2], handle.out_shape[-1]
        owner, local = handle.owner, handle.local
        handle.requests, handle.replies, handle.peers, handle.posted = [], [], [], True
        x_np = None
        for rank in np.unique(owner).tolist():
            slots = np.flatnonzero(owner == rank)
            if rank == 0 or rank in handle.adopted:
                continue
            if rank in self.adopted:
                layer = handle.ownership.layer
                handle.adopted[rank] = (slots, self.adopted[rank](layer, self._batch(handle, slots)))
                continue
            x_np = wire.to_numpy(handle.xs) if x_np is None else x_np  # [T, D]
            rows, slot_rows = np.unique(slots // K, return_inverse=True)  # each token once per rank
            msg = wire.pack(wire.OP_EXPERTS, handle.ownership.layer, handle.dtype, local[slots], slot_rows, x_np[rows],
                            ACTIVITY.step, handle.flat.size)
            reply = np.empty((slots.size, D), dtype=x_np.dtype)
            handle.replies.append((slots, reply))
            handle.peers.append(rank)
            self.stats.bytes_sent += msg.nbytes
            self.stats.rows_sent += rows.size
            self.stats.bytes_received += reply.nbytes
            try:
                dest = self.world.peer(rank)
                handle.requests.append(self.world.comm.Isend(msg, dest=dest, tag=wire.TAG_EXPERTS))
                handle.requests.append(self.world.comm.Irecv(reply, source=dest, tag=wire.TAG_RESULT))
            except survival.peer_errors(self.world):  # combine recovers and posts again
                handle.posted = False
                return

    def combine(self, y: Optional[mx.array], handle: P2PHandle) -> mx.array:
        D = handle.out_shape[-1]
        out = np.empty((int(np.prod(handle.out_shape[:-1])), D), dtype=wire.NUMPY_DTYPES[handle.dtype])  # [S, D]
        if y is not None:
            tic = time.perf_counter()
            out[handle.local_slots] = wire.to_numpy(y.reshape(-1, D))  # [s0, 1, D] -> [s0, D]
            self.stats.compute_seconds += time.perf_counter() - tic
        tic = time.perf_counter()
        while True:
            try:
                if handle.posted:
                    self._wait(handle)
                    break
            except survival.peer_errors(self.world):
                pass
            survival.recover(self.world)  # rank 0 now holds the lost ranks' experts (self.adopted)
            self._post(handle)
        ACTIVITY.progress()
        self.stats.wait_seconds += time.perf_counter() - tic
        for slots, reply in handle.replies:
            out[slots] = reply
        for slots, y_lost in handle.adopted.values():
            out[slots] = wire.to_numpy(y_lost.reshape(-1, D))
        return wire.from_numpy(out, handle.dtype).reshape(handle.out_shape)  # [S, D] -> [.., K, D]

    def _wait(self, handle: P2PHandle) -> None:
        """Wait for the replies as they come, so a stall names the ranks still owing one."""
        from mpi4py import MPI

        owing = dict(enumerate(handle.peers))
        while owing:
            ACTIVITY.at("exchange", ACTIVITY.layer, sorted(owing.values()))
            for i in MPI.Request.Waitsome(handle.requests) or []:
                if i % 2 == 1:
                    owing.pop(i // 2, None)
        MPI.Request.Waitall(handle.requests)

    def progress_after_combine(self, layer: int) -> Tuple[str, Optional[int]]:
        return ("dense", layer)  # the exchange has completed (on the host)

    def finish(self) -> None:
        """Release the workers from ``serve`` (end of a generation)."""
        message = wire.done_message(self.generation)
        while True:
            try:
                for peer in range(1, self.world.comm.Get_size()):
                    self.world.comm.Send(message, dest=peer, tag=wire.TAG_EXPERTS)
                break
            except survival.peer_errors(self.world):  # recover and tell every survivor again
                survival.recover(self.world)
        self.generation += 1

    def serve(self, experts: ExpertFn, ownership: Dict[int, LayerOwnership],
              on_layer: Optional[LayerHook] = None) -> None:
        """A worker's part in one generation: compute ``experts`` on each
        batch rank 0 sends, until it says DONE. ``on_layer(layer, step)`` runs
        before each batch (the test-only fault injection)."""
        from mpi4py import MPI

        status = MPI.Status()
        while True:
            ACTIVITY.at("serving")
            try:
                msg = self._serve_one(experts, ownership, on_layer, status)
            except survival.peer_errors(self.world):  # rank 0 sends the layer again
                survival.recover(self.world)
                continue
            if msg.op == wire.OP_DONE:
                if msg.step < self.generation:
                    continue  # sent again after a loss; this worker had it already
                self.generation += 1
                return

    def _serve_one(self, experts: ExpertFn, ownership: Dict[int, LayerOwnership], on_layer: Optional[LayerHook],
                   status) -> wire.Message:
        """Receive one message from rank 0 and, unless it is DONE, answer it."""
        from mpi4py import MPI

        comm, stats = self.world.comm, self.stats
        comm.Probe(source=0, tag=wire.TAG_EXPERTS, status=status)
        buf = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)
        comm.Recv(buf, source=0, tag=wire.TAG_EXPERTS)
        msg = wire.unpack(buf)
        if msg.op == wire.OP_DONE:
            return msg
        ACTIVITY.step = msg.step
        ACTIVITY.prefill = False  # one layer's experts at a time: the plain deadline
        ACTIVITY.at("experts", msg.layer)
        if on_layer is not None:
            on_layer(msg.layer, msg.step)
        tic = time.perf_counter()
        rows = msg.local_ids.size
        x = msg.x[mx.array(msg.slot_rows)]  # [u, D] -> [s, D]
        batch = ExpertBatch(x, mx.array(msg.local_ids)[:, None], msg.total_slots)  # [s, D], [s, 1]
        y = experts(msg.layer, batch)  # [s, 1, D]
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
        return msg
