"""The one interface every exchange strategy implements."""

from dataclasses import dataclass
from typing import Any, Optional, Protocol, Tuple

import mlx.core as mx

from .ownership import LayerOwnership
from .stats import ExchangeStats


@dataclass(frozen=True)
class ExpertBatch:
    """What this rank's experts compute for one layer."""

    x: mx.array  # [.., D] rows
    inds: mx.array  # [.., k] local expert ids (positions in this rank's stack)


class Dispatcher(Protocol):
    """Moves a layer's (row, expert) slots to the experts' owners and back.

    ``dispatch`` returns this rank's share of the work (None if it has none)
    and an opaque handle; ``combine`` takes the experts' output for that
    share and the handle, and returns every slot, ``[.., K, D]``, exactly as
    one process computes it (except where a mode says otherwise).
    """

    name: str
    stats: ExchangeStats

    def dispatch(self, ownership: LayerOwnership, x: mx.array, inds: mx.array) -> Tuple[Optional[ExpertBatch], Any]:
        ...

    def combine(self, y: Optional[mx.array], handle: Any) -> mx.array:
        ...

    def progress_after_combine(self, layer: int) -> Tuple[str, Optional[int]]:
        """The watchdog's (phase, layer) once ``combine`` has returned."""
        ...

    def finish(self) -> None:
        """End of one generation (release any rank waiting on this one)."""
