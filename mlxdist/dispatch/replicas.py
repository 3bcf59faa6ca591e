"""N replicas: every rank holds every expert and runs its own sequences
through the model as one process would; no MoE layer exchanges anything.

    x_r [T_r, D], inds_r [T_r, K]   this rank's rows and their routing
    y_r = experts(x_r, inds_r)      [T_r, K, D], every slot computed here

``auto`` loads this mode in place of dp where every rank has room for
the whole model (``engine/load.py``): a batch of at least one sequence per
rank then costs each rank its share of the dense work and of the experts',
and each rank decodes its share alone, the tokens gathered once at the end
(``engine/replicas.py``; the server's data-parallel generator runs it in
lockstep, ``engine/dp_schedule.py``, gathering each step's tokens, which is
what ``plan``, ``last`` and ``empty_input`` serve). A single sequence runs
``collective-tp`` or ``collective``, which split its work over the ranks,
or, where the link costs that more than it saves, alone on rank 0
(``linkcost.py``).

Each rank's rows go through mlx-lm's own expert module in one batch, so a
sequence's tokens are those of one process decoding that rank's sequences
together; not bit-equal to one process decoding the whole batch (another
batch shape), like dp.
"""

from typing import Any, Optional, Tuple

import mlx.core as mx

from mlxdist.dispatch.base import Combine, ExpertBatch, RowDispatcher
from mlxdist.dispatch.ownership import LayerOwnership
from mlxdist.dispatch.stats import ExchangeStats
from mlxdist.runtime.world import World


class ReplicaDispatcher(RowDispatcher):
    name = "replicas"
    exchanges = False

    def __init__(self, world: World, dtype: mx.Dtype = mx.float32, top_k: int = 0, **_):
        self.world = world
        self.dtype = dtype
        self.top_k = top_k
        self.stats = ExchangeStats()

    @property
    def combines(self) -> Combine:
        return Combine.SLOTS

    @property
    def exact(self) -> bool:
        return self.world.size == 1

    def plan(self, rows_per_rank: list, prompt_only: bool = False) -> None:
        """Nothing to line up: no rank waits for another inside a forward."""

    def dispatch(self, ownership: LayerOwnership, x: mx.array, inds: mx.array,
                 weights: Optional[mx.array] = None) -> Tuple[Optional[ExpertBatch], Any]:
        if len(ownership.owned_experts) != ownership.num_experts:
            raise RuntimeError(f"layer {ownership.layer}: replicas need every expert on every rank, rank "
                               f"{ownership.rank} holds {len(ownership.owned_experts)} of {ownership.num_experts}")
        self.stats.layers += 1
        load = self.stats.count(ownership.layer, inds, ownership.num_experts)
        if load is not None:
            x = mx.depends(x, load)
        self.stats.slots_local += inds.size
        # Every rank holds every expert in one stack, in global order: the ids are the positions.
        return ExpertBatch(x, inds), None

    def combine(self, y: Optional[mx.array], handle: Any) -> mx.array:
        return y

    def empty_input(self, width: int) -> Tuple[mx.array, mx.array, mx.array]:
        return (mx.zeros((0, width), dtype=self.dtype), mx.zeros((0, max(self.top_k, 1)), dtype=mx.int32),
                mx.zeros((0, max(self.top_k, 1)), dtype=mx.float32))

    @property
    def last(self) -> Optional[mx.array]:
        """No collective is built inside a forward: a rank without rows has nothing to wait for."""
        return None
