"""The distributed expert module that takes the place of mlx-lm's
``SwitchGLU``/``SwitchMLP``: same call, same result, experts on many ranks.

The model's own block still routes (softmax, top-k, grouping, shared experts)
and weights the slots by its scores; only ``y = switch(x, inds)`` changes.
"""

from typing import Callable, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from .dispatch import Dispatcher, LayerOwnership
from .watchdog import ACTIVITY, Fault

# observer(switch, boundary, arrays): called at "input", "dispatched",
# "experts" and "combined" of every layer while set (see ``Engine.observe``).
Observer = Callable[["DistributedSwitch", str, Tuple[mx.array, ...]], None]


class DistributedSwitch(nn.Module):
    """``y[.., K, D] = switch(x[.., D], inds[.., K])`` over every rank.

    ``experts`` is mlx-lm's own expert module holding only this rank's
    experts (None where it owns none in this layer); ``dispatcher`` moves the
    slots to their owners and back. ``first`` marks the model's first MoE
    layer, where a forward step begins (for the watchdog's step count).
    """

    def __init__(
        self,
        ownership: LayerOwnership,
        experts: Optional[nn.Module],
        dispatcher: Dispatcher,
        first: bool = False,
        fault: Optional[Fault] = None,
    ):
        super().__init__()
        self.ownership = ownership
        self.experts = experts
        self.dispatcher = dispatcher
        self.first = first
        self.fault = fault  # test-only fault injection; None in real runs
        self.observer: Optional[Observer] = None

    def __call__(self, x: mx.array, inds: mx.array) -> mx.array:
        layer = self.ownership.layer
        if self.first:
            ACTIVITY.step += 1
        ACTIVITY.beat("experts", layer)
        if self.fault is not None:
            self.fault.maybe_fire(layer, ACTIVITY.step)
        observer = self.observer
        if observer is not None:
            observer(self, "input", (x, inds))
        batch, handle = self.dispatcher.dispatch(self.ownership, x, inds)
        if observer is not None:
            observer(self, "dispatched", ())
        y = None
        if batch is not None and self.experts is not None:
            y = self.experts(batch.x, batch.inds)
        if observer is not None:
            observer(self, "experts", () if y is None else (y,))
        out = self.dispatcher.combine(y, handle)
        if observer is not None:
            observer(self, "combined", (out,))
        ACTIVITY.beat(*self.dispatcher.progress_after_combine(layer))
        return out
