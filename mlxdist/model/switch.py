"""The distributed expert module that takes the place of mlx-lm's
``SwitchGLU``/``SwitchMLP``: same call, same result, experts on many ranks.

The model's own block still routes (softmax, top-k, grouping, shared experts)
and weights the slots by its scores; only ``y = switch(x, inds)`` changes.
"""

from typing import Any, Callable, Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from mlxdist.dispatch import Combine, DenseRanks, Dispatcher, LayerOwnership
from mlxdist.model.experts import call_unsorted, run_experts
from mlxdist.model.routing import RouterWeights, SlotTap, block_with_weights
from mlxdist.runtime import faults
from mlxdist.runtime.watchdog import ACTIVITY

# observer(switch, boundary, arrays): called at "input", "dispatched",
# "experts" and "combined" of every layer while set (see ``Engine.observe``);
# where whole blocks are exchanged "input" carries the rows only, and "block"
# (the block's partial output, before the reduce) comes between the last two.
Observer = Callable[["DistributedSwitch", str, Tuple[mx.array, ...]], None]


class DistributedSwitch(nn.Module):
    """``y[.., K, D] = switch(x[.., D], inds[.., K])`` over every rank.

    ``experts`` is mlx-lm's own expert module holding only this rank's
    experts (None where it owns none in this layer); ``dispatcher`` moves the
    slots to their owners and back. ``first`` marks the model's first MoE
    layer, where a forward step begins (for the watchdog's step count).
    ``extras``: what the model hung on its expert module besides the experts
    (``checkpoint.switch_extras``), exposed under the same names because the
    block reads them there.
    """

    def __init__(
        self,
        ownership: LayerOwnership,
        experts: Optional[nn.Module],
        dispatcher: Dispatcher,
        opens_forward: bool = False,
        extras: Optional[Dict[str, Any]] = None,
    ):
        super().__init__()
        self.ownership = ownership
        self.experts = experts
        self.dispatcher = dispatcher
        self.opens_forward = opens_forward  # the model's first MoE layer: a forward pass begins here
        self.observer: Optional[Observer] = None
        self.router: Optional[RouterWeights] = None  # set where the block's router weights are read (dp)
        self._tap: Optional[SlotTap] = None  # inside run_block, per token: the slots the block weights
        for name, value in (extras or {}).items():
            if name in self or hasattr(self, name):
                raise ValueError(f"the expert module carries {name!r}, a name DistributedSwitch uses itself")
            setattr(self, name, value)

    def __call__(self, x: mx.array, inds: mx.array) -> mx.array:
        layer = self.ownership.layer
        if not self.wraps_block:  # else the forward began around the block (run_block)
            self._maybe_begin_forward(x)
        ACTIVITY.at("experts", layer)
        if faults.FAULT is not None:
            faults.at_layer(layer, ACTIVITY.step)
        observer = self.observer
        if self.wraps_block:  # inside exchange_block: the rows are here already, the sum comes after the block
            if observer is not None:
                observer(self, "dispatched", (x, inds))
            y = call_unsorted(self.experts, x, inds)
            if observer is not None:
                observer(self, "experts", (y,))
            return y
        if self._tap is not None:  # per token: the block weights stand-in slots; run_block exchanges after it
            return self._tap.take(x, inds)
        return self._exchange(x, inds, None)

    def _exchange(self, x: mx.array, inds: mx.array, weights: Optional[mx.array]) -> mx.array:
        """The slots ``y[.., K, D]`` of ``x``'s rows over every rank (per
        token: their ``weights``-weighted sum ``[.., D]``)."""
        layer = self.ownership.layer
        observer = self.observer
        if observer is not None:
            observer(self, "input", (x, inds))
        batch, handle = self.dispatcher.dispatch(self.ownership, x, inds, weights)
        if observer is not None:
            observer(self, "dispatched", ())
        y = None
        if batch is not None and self.experts is not None:
            y = run_experts(self.experts, batch)
        if observer is not None:
            observer(self, "experts", () if y is None else (y,))
        out = self.dispatcher.combine(y, handle)
        if observer is not None:
            observer(self, "combined", (out,))
        ACTIVITY.at(*self.dispatcher.progress_after_combine(layer))
        return out

    def _maybe_begin_forward(self, x: mx.array) -> None:
        """At the model's first MoE layer a forward pass begins."""
        if self.opens_forward:
            ACTIVITY.begin_forward(prefill=x.ndim >= 3 and x.shape[-2] > 1)  # [B, L, D]: L tokens each
            self.dispatcher.begin_forward()

    def _set_tap(self, tap: Optional[SlotTap]) -> None:
        self._tap = tap

    @property
    def wraps_block(self) -> bool:
        """Whether the dispatcher exchanges whole blocks (experts cut in width)."""
        return self.dispatcher.combines is Combine.BLOCKS

    def serve_idle(self, width: int) -> None:
        """This rank's part in one MoE layer of a forward pass in which it
        has no rows of its own (``dense_ranks`` OWN): serve its experts to the
        other ranks' rows."""
        dispatcher = self.dispatcher
        assert dispatcher.dense_ranks is DenseRanks.OWN
        x, inds, weights = dispatcher.empty_input(width)
        batch, handle = dispatcher.dispatch(self.ownership, x, inds, weights)
        y = run_experts(self.experts, batch) if batch is not None and self.experts is not None else None
        dispatcher.combine(y, handle)

    def run_block(self, block: Callable[[mx.array], mx.array], x: mx.array) -> mx.array:
        """The MoE block around this switch, ``block(x)``: exchanged whole
        over the ranks where the dispatcher does that (experts cut in width),
        else run here, plus the per-token combine's sums where there are any."""
        if not self.wraps_block:
            if self.dispatcher.combines is not Combine.TOKENS:
                return block(x)
            out, tap, weights = block_with_weights(lambda: block(x), self._set_tap, x, self.router)
            combined = self._exchange(tap.x, tap.inds, weights)
            # A block that routes flattened rows (olmoe, minimax_m3_vl) reshapes its output back.
            return out + combined.astype(out.dtype).reshape(out.shape)
        self._maybe_begin_forward(x)
        observer = self.observer
        if observer is None:
            out = self.dispatcher.exchange_block(self.ownership.layer, block, x)
        else:  # boundaries: input (x), dispatched and experts (in __call__), block (its output), combined
            observer(self, "input", (x,))

            def observed(rows: mx.array) -> mx.array:
                partial = block(rows)
                observer(self, "block", (partial,))
                return partial

            out = self.dispatcher.exchange_block(self.ownership.layer, observed, x)
            observer(self, "combined", (out,))
        ACTIVITY.at(*self.dispatcher.progress_after_combine(self.ownership.layer))
        return out


class MoEBlock(nn.Module):
    """A model's MoE block, run through its switch (``run_block``).

    With a per-slot dispatcher the switch returns every slot and nothing is
    added. With a per-token one (``Combine.TOKENS``) the switch
    returns zeros, so the block yields only what it adds itself (shared
    experts), and the exchange's router-weighted sum is added after it. With
    experts cut in width the whole block is exchanged over the ranks.
    """

    def __init__(self, block: nn.Module, switch: DistributedSwitch):
        super().__init__()
        self.block = block
        self._run_block = switch.run_block  # a bound method: not a child module

    def __call__(self, x: mx.array, *args, **kwargs) -> mx.array:
        return self._run_block(lambda rows: self.block(rows, *args, **kwargs), x)
