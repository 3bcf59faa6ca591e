"""What a dispatcher declares about itself, as values: what ``combine``
returns (``Combine``) and who runs the dense model (``DenseRanks``). Below
``base.py`` (the interface) and ``stats.py`` (its counters), which both read
them.
"""

from enum import Enum


class Combine(str, Enum):
    SLOTS = "slots"  # [.., K, D]: every slot, as one process's expert module returns them
    TOKENS = "tokens"  # [.., D]: each token's router-weighted sum over its experts
    BLOCKS = "blocks"  # whole MoE blocks exchanged (experts cut in width)


class DenseRanks(str, Enum):
    ALL = "all"  # every rank runs the dense model on every token
    ROOT = "root"  # rank 0 alone; the other ranks hold experts only
    OWN = "own"  # each rank its own sequences (data-parallel attention)
