"""A long chunk's attention split by heads over ranks that run the same rows.

Notation: B sequences, H query heads, Hk key-value heads, L queries (the
chunk), S keys, d head width, N ranks, r this rank.

In ``collective`` every rank runs the dense model on the same rows, and a
prompt's attention (quadratic in its length) is the part that grows: at a
few thousand tokens it is most of a prefill, repeated on every rank. Here
each rank computes the attention of its H/N heads (and their Hk/N key-value
heads), and one ``all_gather`` of [H/N, B, L, d] gives every rank all H.
Each head's attention is computed alone, by the same kernel, on the same
inputs as in one process, and gathering moves bits without arithmetic: the
result is bit-identical (tested against mlx-lm). Projections, the KV cache
and everything after stay whole on every rank, so decode steps are as before.

Only chunks of at least ``MIN_QUERIES`` queries are split (prefill chunks;
never a decode step or a drafted verify), and only where the heads divide:
H and Hk by N, or a single key-value head shared by all. Every rank decides
from the shapes alone, so every rank calls the ``all_gather`` or none does.

The model's attention modules find this function under the name they look
up (``scaled_dot_product_attention``, mlx-lm's ``models/base.py``): each
instance gets a subclass whose ``__call__`` is a copy with that one name
changed (``compat.with_module_names``); mlx-lm's modules stay as they are.
"""

from typing import Any, Callable, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import base

from mlxdist.compat import with_module_names

__all__ = ["MIN_QUERIES", "HeadSplit", "install"]

MIN_QUERIES = 256  # queries in a chunk from which its attention is split (a decode step has 1)
_NAME = "scaled_dot_product_attention"


class HeadSplit:
    """The switch and the count: ``on`` while the mode in use runs the
    same rows with every head on every rank (``Engine.use``); ``chunks``:
    attention calls split so far on this rank."""

    def __init__(self, group: mx.distributed.Group):
        self.group = group
        self.on = False
        self.chunks = 0

    def splits(self, queries: mx.array, keys: mx.array, cache: Any, mask: Any, sinks: Optional[mx.array]) -> bool:
        """Whether this call is split: from shapes alone, alike on every rank."""
        n = self.group.size()
        if not self.on or n == 1 or queries.ndim != 4 or queries.shape[2] < MIN_QUERIES or hasattr(cache, "bits"):
            return False
        heads, kv_heads = queries.shape[1], keys.shape[1]
        if heads % n or (kv_heads != 1 and (kv_heads % n or heads % kv_heads)):
            return False
        if isinstance(mask, mx.array) and mask.ndim == 4 and mask.shape[1] not in (1, heads):
            return False
        return sinks is None or (sinks.ndim == 1 and sinks.shape[0] == heads)

    def attention(self, queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float,
                  mask: Any, sinks: Optional[mx.array] = None) -> mx.array:
        """mlx-lm's ``scaled_dot_product_attention``, this rank's heads
        computed here and the others gathered: [B, H, L, d] as in one process."""
        if not self.splits(queries, keys, cache, mask, sinks):
            return base.scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks)
        self.chunks += 1
        n, r = self.group.size(), self.group.rank()
        heads, kv_heads = queries.shape[1], keys.shape[1]
        q = slice(r * heads // n, (r + 1) * heads // n)
        kv = slice(r * kv_heads // n, (r + 1) * kv_heads // n) if kv_heads > 1 else slice(None)
        if isinstance(mask, mx.array) and mask.ndim == 4 and mask.shape[1] == heads:
            mask = mask[:, q]
        sinks = None if sinks is None else sinks[q]
        mine = base.scaled_dot_product_attention(queries[:, q], keys[:, kv], values[:, kv], cache, scale, mask,
                                                 sinks)  # [B, H/N, L, d]
        every = mx.distributed.all_gather(mine.transpose(1, 0, 2, 3), group=self.group)  # [H/N, B, L, d] -> [H, B, L, d]
        return every.transpose(1, 0, 2, 3)  # [H, B, L, d] -> [B, H, L, d]


def install(model: nn.Module, group: Optional[mx.distributed.Group]) -> Optional[HeadSplit]:
    """Point every module of ``model`` whose ``__call__`` calls mlx-lm's
    ``scaled_dot_product_attention`` at a ``HeadSplit`` (off until turned
    on); None where no module does or there is one rank."""
    if group is None or group.size() == 1:
        return None
    split = HeadSplit(group)
    subclasses = {}
    for _, module in model.named_modules():
        cls = type(module)
        if cls not in subclasses:
            subclasses[cls] = _subclass(cls, split.attention)
        if subclasses[cls] is not None:
            module.__class__ = subclasses[cls]
    return split if any(subclasses.values()) else None


def _subclass(cls: type, attention: Callable) -> Optional[type]:
    """``cls`` with a ``__call__`` that finds ``attention`` under mlx-lm's
    name, or None where its ``__call__`` does not look that function up."""
    call = cls.__call__
    code = getattr(call, "__code__", None)
    if code is None or _NAME not in code.co_names or call.__globals__.get(_NAME) is not base.scaled_dot_product_attention:
        return None
    return type(cls.__name__, (cls,), {"__call__": with_module_names(call, {_NAME: attention}),
                                       "__module__": cls.__module__, "__qualname__": cls.__qualname__})
