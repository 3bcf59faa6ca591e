"""Moving each MoE layer's (row, expert) slots to the ranks that own the
experts, and back.

Notation: T rows (tokens) in the layer's input, K experts per token, D model
width, S = T * K slots, E experts in the layer.

    DistributedSwitch(x [.., D], inds [.., K])               (model/switch.py)
      batch, handle = dispatcher.dispatch(ownership, x, inds)  # this rank's share
      y_local       = run_experts(experts, batch)              # its own experts (model/experts.py)
      y             = dispatcher.combine(y_local, handle)      # [.., K, D], every slot

The interface (``base.py``) declares every hook and what each mode's dispatcher is;
``modes.py`` holds the modes a user picks (``auto``'s rule is in
``mlxdist/decide/``). One mode's dispatcher
per module, built by name in ``make_dispatcher``:

    collective     collective.py    all ranks run the dense model; one all_sum per layer
    collective-tp  collective.py    the same, attention split by mlx-lm's shard() (not bit-exact)
    p2p            p2p.py           rank 0 runs the dense model, sends slots to owners
    dp             dataparallel.py  each rank its own sequences; per-token combine (not bit-exact)
    replicas       replicas.py      each rank its own sequences, every expert on every rank: no exchange

``auto`` holds both collective and dp (with experts cut in width on MPI,
collective-tp too; where every rank has room for the whole model, replicas
in place of dp) and picks per batch the one whose step costs the least
over the link measured at load (``decide/rule.py``'s ``auto_choice``).

``ownership.py`` holds the per-layer expert-to-rank map, ``stats.py`` the
counters, ``wire.py`` the p2p message format (what each mode puts on the
wire per step is ``decide/traffic.py``). With one rank every mode
is an identity: the expert module sees the layer's input as is.
"""

from mlxdist.dispatch.base import Combine, DenseRanks, Dispatcher, ExpertBatch, RowDispatcher
from mlxdist.dispatch.collective import LAYOUTS, CollectiveDispatcher, default_layout
from mlxdist.dispatch.dataparallel import DataParallelDispatcher
from mlxdist.dispatch.modes import DISPATCH_MODES, LOADABLE_MODES
from mlxdist.dispatch.ownership import LayerOwnership
from mlxdist.dispatch.p2p import P2PDispatcher
from mlxdist.dispatch.replicas import ReplicaDispatcher
from mlxdist.dispatch.stats import ExchangeStats
from mlxdist.runtime.world import World

__all__ = [
    "DISPATCH_MODES", "LAYOUTS", "CollectiveDispatcher", "Combine", "DataParallelDispatcher", "DenseRanks",
    "Dispatcher", "ExchangeStats", "ExpertBatch", "LayerOwnership", "P2PDispatcher", "ReplicaDispatcher",
    "RowDispatcher",
    "default_layout", "make_dispatcher",
]


def make_dispatcher(mode: str, world: World, layout: str = "masked", stats: bool = False,
                    wraps_blocks: bool = False, **dp_shape) -> Dispatcher:
    """The one place a dispatcher is built by its mode's name (``replicas`` too,
    which ``auto`` loads where every rank holds every expert). ``layout`` applies to the
    collective and dp modes; ``stats`` starts with per-expert load counting
    on; ``wraps_blocks``: experts cut in width, whole MoE blocks exchanged
    (collective and dp); ``dp_shape`` (top_k, dtype) describes a dp layer's input."""
    if mode not in LOADABLE_MODES:
        raise ValueError(f"unknown mode {mode!r} (choose {', '.join(LOADABLE_MODES)})")
    if mode == "collective" or world.size == 1:  # one rank: every mode is the identity
        dispatcher = CollectiveDispatcher(world, layout, wraps_blocks=wraps_blocks)
    elif mode == "collective-tp":  # whole experts: each MoE block sums its output itself (mlx-lm's shard())
        dispatcher = CollectiveDispatcher(world, layout, reduce=wraps_blocks, wraps_blocks=wraps_blocks,
                                          splits_attention=True)
    elif mode == "dp":
        dispatcher = DataParallelDispatcher(world, layout, wraps_blocks=wraps_blocks, **dp_shape)
    elif mode == "replicas":
        dispatcher = ReplicaDispatcher(world, **dp_shape)
    else:
        dispatcher = P2PDispatcher(world)
    dispatcher.stats.collect_expert_load = stats
    return dispatcher
