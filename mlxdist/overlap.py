"""Whether decoding keeps the next step in flight.

mlx-lm's ``generate_step`` and ``BatchGenerator``, and mlxdist's data-parallel
loop (``dp.py``), build step t + 1 and start it with ``mx.async_eval`` before
reading step t's tokens, so the host's graph building overlaps the device's
work. ``MLXDIST_DECODE_OVERLAP=0`` evaluates each step before the next is
built instead (``mx.async_eval`` becomes ``mx.eval`` for the generation).
"""

import os
from contextlib import contextmanager
from typing import Iterator

import mlx.core as mx


def overlaps_decode(backend: str) -> bool:
    """Whether decode steps overlap on ``backend`` (the environment decides where it says)."""
    setting = os.environ.get("MLXDIST_DECODE_OVERLAP")
    if setting is not None:
        return setting.strip() not in ("0", "false", "no")
    return True


@contextmanager
def decode_steps(overlap: bool) -> Iterator[None]:
    """Run a generation with its steps in flight (``overlap``) or one at a time."""
    if overlap:
        yield
        return
    start = mx.async_eval
    mx.async_eval = mx.eval
    try:
        yield
    finally:
        mx.async_eval = start
