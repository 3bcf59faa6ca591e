"""Moving each MoE layer's (row, expert) slots to the ranks that own the
experts, and back.

Notation: T rows (tokens) in the layer's input, K experts per token, D model
width, S = T * K slots, E experts in the layer.

    DistributedSwitch(x [.., D], inds [.., K])               (moe.py)
      batch, handle = dispatcher.dispatch(ownership, x, inds)  # this rank's share
      y_local       = experts(batch.x, batch.inds)             # its own experts
      y             = dispatcher.combine(y_local, handle)      # [.., K, D], every slot

One strategy per module, chosen by name in ``make_dispatcher``:

    collective     collective.py  all ranks run the dense model; one all_sum per layer
    collective-tp  collective.py  the same, attention split by mlx-lm's shard() (not bit-exact)
    p2p            p2p.py         rank 0 runs the dense model, sends slots to owners

``ownership.py`` holds the per-layer expert-to-rank map, ``stats.py`` the
counters, ``wire.py`` the p2p message format. With one rank every strategy
is an identity: the expert module sees the layer's input as is.
"""

from ..mpi import World
from .base import Dispatcher, ExpertBatch
from .collective import LAYOUTS, CollectiveDispatcher
from .ownership import LayerOwnership
from .p2p import P2PDispatcher
from .stats import ExchangeStats

DISPATCH_MODES = ("collective", "p2p", "collective-tp")

__all__ = [
    "DISPATCH_MODES", "LAYOUTS", "CollectiveDispatcher", "Dispatcher", "ExchangeStats", "ExpertBatch",
    "LayerOwnership", "P2PDispatcher", "make_dispatcher",
]


def make_dispatcher(mode: str, world: World, layout: str = "masked", stats: bool = False) -> Dispatcher:
    """The one place a strategy is chosen by name. ``layout`` applies to the
    collective modes; ``stats`` starts with per-expert load counting on."""
    if mode not in DISPATCH_MODES:
        raise ValueError(f"unknown dispatch mode {mode!r} (choose {', '.join(DISPATCH_MODES)})")
    if mode == "collective" or world.size == 1:  # one rank: every mode is the identity
        dispatcher = CollectiveDispatcher(world, layout)
    elif mode == "collective-tp":
        dispatcher = CollectiveDispatcher(world, layout, reduce=False)
    else:
        dispatcher = P2PDispatcher(world)
    dispatcher.stats.collect_expert_load = stats
    return dispatcher
