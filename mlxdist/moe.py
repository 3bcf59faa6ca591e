"""The distributed expert module that takes the place of mlx-lm's
``SwitchGLU``/``SwitchMLP``: same call, same result, experts on many ranks.

The model's own block still routes (softmax, top-k, grouping, shared experts)
and weights the slots by its scores; only ``y = switch(x, inds)`` changes.
"""

from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from .dispatch import ExpertShard
from .watchdog import ACTIVITY, inject


class DistributedSwitch(nn.Module):
    """``y[.., K, D] = switch(x[.., D], inds[.., K])`` over every rank.

    ``experts`` is mlx-lm's own expert module holding only this rank's
    experts (None where it owns none in this layer); ``dispatcher`` moves the
    slots to their owners and back.
    """

    def __init__(self, shard: ExpertShard, experts: Optional[nn.Module], dispatcher, first: bool = False):
        super().__init__()
        self.shard = shard
        self.experts = experts
        self.dispatcher = dispatcher
        self.first = first  # the model's first MoE layer: a new forward step starts here

    def __call__(self, x: mx.array, inds: mx.array) -> mx.array:
        layer = self.shard.layer
        if self.first:
            ACTIVITY.step += 1
        ACTIVITY.beat("experts", layer)
        inject(layer, ACTIVITY.step)
        batch, handle = self.dispatcher.dispatch(self.shard, x, inds)
        y = None
        if batch is not None and self.experts is not None:
            y = self.experts(batch.x, batch.inds)
        y = self.dispatcher.combine(y, handle)
        ACTIVITY.beat(*self.dispatcher.after_combine(layer))
        return y
