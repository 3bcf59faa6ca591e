"""The router weights of an mlx-lm MoE block, read through the block itself.

Every mlx-lm MoE block routes, calls its expert module as ``y = switch(x,
inds)`` and then weights the slots, however its code spells it:

    out = rest(x) + sum_k w[.., k] * y[.., k, :]      (shared experts, ... in rest)

The per-token combine (``dispatch/dataparallel.py``) needs ``w`` on the
experts' ranks. ``out`` is linear in ``y``, so ``w`` is its derivative: the
block runs once as a function of the slots (``mx.vjp``), the switch
handing it a stand-in ``y`` of zeros, and the vector-Jacobian product with a
cotangent that is 1 in one column of ``out`` and 0 elsewhere is, per slot,
``1 * w[.., k]`` plus exact zeros: the block's own weights, bit for bit,
whatever the block names them or however it computes them (softmax, sigmoid
with a bias, a scaling factor). Nothing outside the block is read: no frame,
no name.

A probe at load checks, per block class, that the block is linear in its
slots (the derivative is the same at zeros and at random slots), that it
weights each slot by one number (the same derivative in every column) and
that the cheap form used at every call (slots of width 1, broadcast) gives
the same numbers; a block that fails any check is refused, naming it.

Notation: T tokens of the block's input, K slots per token (top-k), D width.
"""

import math
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from mlxdist.errors import RoutingWeightsNotFound, one_line
from mlxdist.model.checkpoint import switch_extras


class RouterWeights(NamedTuple):
    """How a block weights its slots: top-k, and the dtype its weights are exact in."""

    top_k: int
    dtype: mx.Dtype


class SlotTap:
    """The stand-in slots a switch hands its block while the block's
    derivative is read, and what the switch was called with."""

    def __init__(self, y: mx.array):
        self.y = y  # [T, K, 1] (broadcast to the width) or [T, K, D]
        self.x: Optional[mx.array] = None
        self.inds: Optional[mx.array] = None

    def take(self, x: mx.array, inds: mx.array) -> mx.array:
        """The switch's result: the stand-in slots, shaped ``inds.shape + (D,)``."""
        if self.inds is not None:
            raise RoutingWeightsNotFound("the MoE block calls its expert module more than once")
        if inds.size != self.y.shape[0] * self.y.shape[1]:
            raise RoutingWeightsNotFound(
                f"the MoE block routes {tuple(inds.shape)} slots, not {self.y.shape[1]} for each of its "
                f"{self.y.shape[0]} input tokens"
            )
        self.x, self.inds = x, inds
        shape = inds.shape + x.shape[-1:]
        return mx.broadcast_to(self.y.reshape(inds.shape + self.y.shape[-1:]), shape)


def block_with_weights(
    block: Callable[[], mx.array], tap_slots: Callable[[Optional[SlotTap]], None], x: mx.array,
    router: RouterWeights,
) -> Tuple[mx.array, SlotTap, mx.array]:
    """``block()`` run with its switch handing out zeros (``tap_slots``
    installs the tap the switch calls, and removes it): (its output, the tap
    holding the switch's ``x`` and ``inds``, the weights ``w`` shaped like
    ``inds``)."""
    zeros, cotangent = _constants(x.shape, x.dtype, router)
    tap = None

    def run(y: mx.array) -> mx.array:
        nonlocal tap
        tap = SlotTap(y)
        tap_slots(tap)
        try:
            out = block()
        finally:
            tap_slots(None)
        if tap.inds is None:
            raise RoutingWeightsNotFound("the MoE block did not call its expert module")
        if out.shape != x.shape:
            raise RoutingWeightsNotFound(f"the MoE block returns {tuple(out.shape)} for an input of {tuple(x.shape)}")
        return out

    (out,), (w,) = mx.vjp(run, [zeros], [cotangent])
    return out, tap, w.reshape(tap.inds.shape)


_CONSTANTS: Dict[Tuple, Tuple[mx.array, mx.array]] = {}


def _constants(shape: Tuple[int, ...], dtype: mx.Dtype, router: RouterWeights) -> Tuple[mx.array, mx.array]:
    """The stand-in slots ``[T, K, 1]`` of zeros and the cotangent (1 in one
    column of the block's output: each slot's derivative is ``w * 1`` plus
    exact zeros), made once per shape (a decode step repeats its shapes)."""
    key = (shape, dtype, router)
    if key not in _CONSTANTS:
        if len(_CONSTANTS) >= 256:
            _CONSTANTS.clear()
        tokens = math.prod(shape[:-1])
        zeros = mx.zeros((tokens, router.top_k, 1), dtype=slot_dtype(dtype, router.dtype))  # [T, K, 1]
        cotangent = mx.broadcast_to((mx.arange(shape[-1]) == 0).astype(dtype), shape)
        mx.eval(zeros, cotangent)
        _CONSTANTS[key] = (zeros, cotangent)
    return _CONSTANTS[key]


def slot_dtype(activations: mx.Dtype, weights: mx.Dtype) -> mx.Dtype:
    """The dtype of the block's ``y * w``: that of its stand-in slots, so its
    output has the dtype it has with real slots."""
    return (mx.zeros((), activations) + mx.zeros((), weights)).dtype


class _StandIn(nn.Module):
    """Takes the expert module's place during the probe, carrying what the
    block reads from it besides calling it (``checkpoint.switch_extras``)."""

    def __init__(self, extras: Dict[str, Any]):
        super().__init__()
        for name, value in extras.items():
            setattr(self, name, value)
        self.tap: Optional[SlotTap] = None
        self.inds: Optional[mx.array] = None  # without a tap: the routing, the slots zeros

    def __call__(self, x: mx.array, inds: mx.array) -> mx.array:
        if self.tap is not None:
            return self.tap.take(x, inds)
        self.inds = inds
        return mx.zeros(inds.shape + x.shape[-1:], x.dtype)


def _full_derivative(block: nn.Module, stand_in: _StandIn, x: mx.array, y: mx.array) -> Tuple[mx.array, SlotTap]:
    """d sum(out) / d y at ``y`` [T, K, D]: (the derivative [T, K, D], the tap)."""
    taps = []

    def run(slots: mx.array) -> mx.array:
        stand_in.tap = SlotTap(slots)
        taps.append(stand_in.tap)
        out = block(x)
        if not isinstance(out, mx.array):
            raise RoutingWeightsNotFound(f"{type(block).__name__} returns {type(out).__name__}, not an array")
        return out

    (out,), (grad,) = mx.vjp(run, [y], [mx.ones(x.shape, x.dtype)])
    return grad, taps[-1]


def find_router_weights(block: nn.Module, switch_attr: str, width: int, dtype: mx.Dtype) -> RouterWeights:
    """Check that ``block`` weights its slots linearly, one number per slot
    (see the module's docstring), with hidden states of ``dtype``: its top-k
    and the dtype its weights are exact in. Leaves the block as it found it."""
    name = type(block).__name__
    switch = getattr(block, switch_attr)
    stand_in = _StandIn(switch_extras(switch))
    x = mx.random.normal((1, 4, width), key=mx.random.key(3)).astype(dtype)  # [1, T=4, D]
    setattr(block, switch_attr, stand_in)
    try:
        try:
            probe_inds = _routing(block, stand_in, x)
            top_k = probe_inds.shape[-1]
            shape = (x.size // width, top_k, width)  # [T, K, D]
            at_zero, _ = _full_derivative(block, stand_in, x, mx.zeros(shape, mx.float32))
            at_random, _ = _full_derivative(block, stand_in, x, mx.random.normal(shape, key=mx.random.key(7)))
            w = at_zero[..., 0]  # [T, K]
            exact_in = dtype if mx.array_equal(w.astype(dtype).astype(mx.float32), w) else mx.float32
            router = RouterWeights(top_k, exact_in)
            out, tap, cheap = block_with_weights(lambda: block(x), lambda t: setattr(stand_in, "tap", t), x, router)
            mx.eval(at_zero, at_random, cheap, out)
        except RoutingWeightsNotFound as e:
            raise RoutingWeightsNotFound(f"cannot find the router weights of {name}: {e}") from None
        except Exception as e:  # not a block that routes for itself (gemma4's expert wrapper takes the routing)
            raise RoutingWeightsNotFound(f"{name} cannot be probed as block(x) ({one_line(e)})") from None
    finally:
        setattr(block, switch_attr, switch)
    why = None
    if not mx.array_equal(at_zero, at_random):
        why = "its output is not linear in its slots"
    elif not mx.array_equal(at_zero, mx.broadcast_to(at_zero[..., :1], at_zero.shape)):
        why = "it does not weight each slot by one number"
    elif mx.all(w == 0).item():
        why = "its output does not depend on its slots"
    elif not mx.array_equal(cheap.astype(mx.float32).reshape(w.shape), w):
        why = "its weights differ with the slots' width"
    if why is not None:
        raise RoutingWeightsNotFound(f"cannot find the router weights of {name}: {why}")
    return router


def _routing(block: nn.Module, stand_in: _StandIn, x: mx.array) -> mx.array:
    """The ``inds`` the block routes ``x`` to (its switch handing out zeros)."""
    stand_in.tap, stand_in.inds = None, None
    out = block(x)
    if not isinstance(out, mx.array):
        raise RoutingWeightsNotFound(f"{type(block).__name__} returns {type(out).__name__}, not an array")
    if stand_in.inds is None:
        raise RoutingWeightsNotFound("the MoE block did not call its expert module")
    return stand_in.inds


def activation_dtype(model: nn.Module) -> mx.Dtype:
    """The dtype hidden states have: the most common floating dtype among the
    model's parameters (float32 or bfloat16 checkpoints, and the scales of
    quantized ones)."""
    from collections import Counter

    from mlx.utils import tree_flatten

    counts = Counter(v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating))
    return counts.most_common(1)[0][0]
