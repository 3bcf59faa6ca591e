"""The router weights of an mlx-lm MoE block, found without per-model code.

Every mlx-lm MoE block routes, calls its expert module as ``y = switch(x,
inds)`` and then weights the slots: ``(y * w[..., None]).sum(-2)`` (plus
shared experts, scaling, whatever the architecture adds). The per-token
combine (``dispatch/dataparallel.py``) needs ``w`` on the experts' ranks, so
at the switch call it is read from the block's own frame: the local array of
``inds``'s shape that the block weights the slots with.

Which local that is (``scores``, ``expert_weights``, ...) is learnt once per
block class at load by a probe, not from a table: the block runs with a
stand-in switch returning known random slots ``y``, and again returning
zeros; the candidate ``w`` for which ``out_zero + sum_k w_k y_k`` reproduces
``out_y`` is the one. A block that fits no candidate is refused, naming it.
"""

import sys
from typing import Any, Dict, NamedTuple, Optional

import mlx.core as mx
import mlx.nn as nn

from mlxdist.errors import RoutingWeightsNotFound
from mlxdist.model.checkpoint import switch_extras


class RouterWeights(NamedTuple):
    """How a block weights its slots: the local's name, its top-k and dtype."""

    name: str
    top_k: int
    dtype: mx.Dtype


def weight_candidates(frame, inds: mx.array) -> Dict[str, mx.array]:
    """The frame's floating arrays shaped like ``inds`` (other than it)."""
    return {
        name: v for name, v in frame.f_locals.items()
        if isinstance(v, mx.array) and v is not inds and v.shape == inds.shape and mx.issubdtype(v.dtype, mx.floating)
    }


def caller_weights(name: str, inds: mx.array, depth: int = 2) -> mx.array:
    """The block's local ``name`` at its call of the switch: ``depth`` frames
    up from here (the switch's ``__call__`` is 1)."""
    value = sys._getframe(depth).f_locals.get(name)
    if value is None or value.shape != inds.shape:
        raise RoutingWeightsNotFound(f"the MoE block has no {name!r} shaped like its routing {tuple(inds.shape)}")
    return value


class _StandIn(nn.Module):
    """Takes the expert module's place during the probe, carrying what the
    block reads from it besides calling it (``loader.switch_extras``)."""

    def __init__(self, zeros: bool, extras: Dict[str, Any]):
        super().__init__()
        for name, value in extras.items():
            setattr(self, name, value)
        self.zeros = zeros
        self.y: Optional[mx.array] = None
        self.candidates: Dict[str, mx.array] = {}

    def __call__(self, x: mx.array, inds: mx.array) -> mx.array:
        self.candidates = weight_candidates(sys._getframe(1), inds)
        shape = inds.shape + x.shape[-1:]
        self.y = mx.zeros(shape, x.dtype) if self.zeros else mx.random.normal(shape, key=mx.random.key(7)).astype(x.dtype)
        return self.y


def find_weights_name(block: nn.Module, switch_attr: str, width: int, dtype: mx.Dtype) -> RouterWeights:
    """The local that ``block`` weights its slots with (see the module's
    docstring): its name, top-k and dtype with hidden states of ``dtype``.
    Leaves the block as it found it."""
    switch = getattr(block, switch_attr)
    x = mx.random.normal((1, 4, width), key=mx.random.key(3)).astype(dtype)
    outputs = {}
    try:
        for zeros in (False, True):
            stand_in = _StandIn(zeros, switch_extras(switch))
            setattr(block, switch_attr, stand_in)
            try:
                out = block(x)
            except Exception as e:  # not a block that routes for itself (gemma4's expert wrapper takes the routing)
                reason = str(e).splitlines()[0] if str(e) else ""
                raise RoutingWeightsNotFound(
                    f"{type(block).__name__} cannot be probed as block(x) ({type(e).__name__}: {reason})"
                ) from None
            if not isinstance(out, mx.array):
                raise RoutingWeightsNotFound(f"{type(block).__name__} returns {type(out).__name__}, not an array")
            outputs[zeros] = (out, stand_in)
    finally:
        setattr(block, switch_attr, switch)
    (out_y, probe), (out_zero, _) = outputs[False], outputs[True]
    scale = mx.abs(out_y).max().item() + 1e-6
    for name, w in sorted(probe.candidates.items()):
        predicted = out_zero + (probe.y.astype(mx.float32) * w.astype(mx.float32)[..., None]).sum(axis=-2)
        if mx.abs(predicted - out_y.astype(mx.float32)).max().item() <= 2e-2 * scale:
            return RouterWeights(name, w.shape[-1], w.dtype)
    raise RoutingWeightsNotFound(
        f"cannot find the router weights of {type(block).__name__} (candidates: {sorted(probe.candidates) or 'none'})"
    )


def activation_dtype(model: nn.Module) -> mx.Dtype:
    """The dtype hidden states have: the most common floating dtype among the
    model's parameters (float32 or bfloat16 checkpoints, and the scales of
    quantized ones)."""
    from collections import Counter

    from mlx.utils import tree_flatten

    counts = Counter(v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating))
    return counts.most_common(1)[0][0]
