"""MLX calls that wait on the device holding Python's lock, made to wait
without it, so the heartbeat and the watchdog threads keep running.

``mx.clear_cache()`` first waits for the work queued before it (an
``async_eval`` whose all-to-all waits on the other ranks), and it holds the
GIL all that time, where ``mx.synchronize()`` releases it while it waits
(measured: a 6.7 s wait, 1 of 668 10-ms ticks of another thread against
664). mlx-lm's ``generate_step`` calls it right after the first token and
every 256th, while the next token's exchange is in flight: a rank lost at
that moment (a cable pulled) left every rank's heartbeat thread without
the GIL, and the job waited for ever instead of naming the rank in
``--heartbeat`` seconds (1 launch in 4 on the namespace hosts, with the
cable pulled at the first token). Synchronizing first leaves
``clear_cache`` nothing to wait for.

    hold_no_lock_while_waiting()   # once, as a rank starts (api.init)
"""

import mlx.core as mx

_ORIGINAL = mx.clear_cache


def _clear_cache() -> None:
    mx.synchronize()  # waits without the GIL
    _ORIGINAL()


def hold_no_lock_while_waiting() -> None:
    """Make ``mx.clear_cache`` (every caller's, mlx-lm's included) wait for
    the queued work without holding the GIL."""
    mx.clear_cache = _clear_cache
