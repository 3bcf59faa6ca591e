"""The one interface every mode's dispatcher implements.

Notation: T rows (tokens) in a layer's input, K experts per token, D model
width, S = T * K slots, E experts in the layer, N ranks.

A dispatcher moves data and nothing else: the experts run where the switch
(``model/switch.py``) or a p2p worker's loop calls ``model/experts.py``.
Each dispatcher declares what it is, and callers ask those properties, never
a mode's name:

    combines       what ``combine`` returns: every slot [.., K, D] (SLOTS),
                   the router-weighted sum per token [.., D] (TOKENS), or
                   whole MoE blocks exchanged by ``exchange_block`` (BLOCKS)
    dense_ranks    who runs the dense model: every rank on every token (ALL),
                   rank 0 alone (ROOT), each rank its own sequences (OWN)
    exact          bit-equal to one process (else: within a tolerance)
    survives_rank_loss   goes on when a rank is lost (ULFM, mpi4py only)
    splits_attention     runs the dense model split by mlx-lm's ``shard()``
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import mlx.core as mx

from mlxdist.dispatch.declared import Combine, DenseRanks
from mlxdist.dispatch.ownership import LayerOwnership
from mlxdist.dispatch.stats import ExchangeStats


@dataclass(frozen=True)
class ExpertBatch:
    """What this rank's experts compute for one layer."""

    x: mx.array  # [.., D] rows
    inds: mx.array  # [.., k] local expert ids (positions in this rank's stack)
    total_slots: int = 0  # slots of the whole layer when this is a subset of them; 0: all of them


# ``experts(layer, batch) -> [s, k, D]`` (None: this rank holds none of the layer's)
ExpertFn = Callable[[int, ExpertBatch], Optional[mx.array]]
# ``on_layer(layer, step)``: called by a p2p worker before each batch (test-only fault injection)
LayerHook = Callable[[int, int], None]


class Dispatcher(ABC):
    """Moves a layer's (row, expert) slots to the experts' owners and back.

    ``dispatch`` returns this rank's share of the work (None if it has none)
    and an opaque handle; ``combine`` takes the experts' output for that
    share and the handle, and returns what ``combines`` says.
    """

    name: str  # the mode, as ``--mode`` names it
    dense_ranks: DenseRanks
    survives_rank_loss: bool = False
    splits_attention: bool = False
    exchanges: bool = True  # its MoE layers move slots between ranks (replicas: none, every expert is here)
    stats: ExchangeStats

    @property
    @abstractmethod
    def combines(self) -> Combine:
        """What ``combine`` (or ``exchange_block``) returns."""

    @property
    @abstractmethod
    def exact(self) -> bool:
        """Whether results are bit-equal to single-process mlx-lm."""

    @abstractmethod
    def dispatch(self, ownership: LayerOwnership, x: mx.array, inds: mx.array,
                 weights: Optional[mx.array] = None) -> Tuple[Optional[ExpertBatch], Any]:
        """x [.., D], inds [.., K] (and, for TOKENS, the router weights [.., K])
        -> (this rank's ExpertBatch or None, handle)."""

    @abstractmethod
    def combine(self, y: Optional[mx.array], handle: Any) -> mx.array:
        """y [s, k, D] (the batch's expert output, None where there was none)
        -> [.., K, D] (SLOTS) or [.., D] (TOKENS)."""

    def exchange_block(self, layer: int, block: Callable[[mx.array], mx.array], x: mx.array) -> mx.array:
        """BLOCKS: the MoE block ``block`` over every rank, x [.., D] -> [.., D]."""
        raise NotImplementedError(f"{self.name} exchanges slots, not whole blocks")

    def begin_forward(self) -> None:
        """A forward pass begins (called at the model's first MoE layer)."""

    def progress_after_combine(self, layer: int) -> Tuple[str, Optional[int]]:
        """The watchdog's (phase, layer) once ``combine`` has returned."""
        return ("exchange", None)  # only the graph is built: it runs, and may wait, later

    def finish(self) -> None:
        """End of one generation (run what is pending; release waiting ranks)."""

    def serve(self, experts: ExpertFn, ownership: Dict[int, LayerOwnership],
              on_layer: Optional[LayerHook] = None) -> None:
        """ROOT: a worker's part in one generation, computing ``experts`` on
        what rank 0 sends until it says the generation is done."""
        raise NotImplementedError(f"{self.name}: every rank runs the dense model; no rank serves")

    def adopt(self, rank: int, experts: ExpertFn) -> None:
        """``survives_rank_loss``: compute the lost ``rank``'s slots with ``experts`` from now on."""
        raise NotImplementedError(f"{self.name} does not go on without a rank")


class RowDispatcher(Dispatcher):
    """OWN: every rank feeds its own rows, and the schedule
    (``engine/dp_schedule.py``) announces every rank's rows for each forward
    pass so that the collectives line up."""

    dense_ranks = DenseRanks.OWN
    dtype: mx.Dtype  # every rank's MoE-layer input dtype
    final_layer: Optional[int] = None  # the MoE layer that is the model's last layer, if any

    @abstractmethod
    def plan(self, rows_per_rank: list, prompt_only: bool = False) -> None:
        """Announce the rows every rank feeds to one coming forward pass."""

    @property
    @abstractmethod
    def last(self) -> Optional[mx.array]:
        """The latest collective built: what a rank that reads none of a
        step's outputs makes its step depend on, so its collectives run too."""

    @abstractmethod
    def empty_input(self, width: int) -> Tuple[mx.array, mx.array, mx.array]:
        """A rank's MoE-layer input with no rows: (x [0, D], inds [0, K], weights [0, K])."""
