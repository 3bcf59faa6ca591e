"""What an agent API's answer (``messages.py``, ``responses.py``) adds to
the front's metrics (``metrics.py``), as the front's own routes add theirs:
its usage to the token counters, the time to its first token, its whole
time, and it counted as queued until its first token and as running meanwhile.

    queued = Queued(metrics)                 # forwarded: queued until its first token or its end
    stack.callback(queued.done)
    async for event in observed(events, metrics, started, queued): ...   # metrics None: events as they are
"""

import time
from typing import Any, AsyncIterator, Optional

from mlxdist.front.translate import Event, Reasoning, Text, ToolCall, Usage


class Queued:
    """One request in ``metrics.queued`` (a ``FrontMetrics``, or None for
    none) from now until ``done()``, which may be called more than once."""

    def __init__(self, metrics: Any):
        self.metrics = metrics
        self.counted = metrics is not None
        if self.counted:
            metrics.queued.inc()

    def done(self) -> None:
        if self.counted:
            self.counted = False
            self.metrics.queued.dec()


async def observed(events: AsyncIterator[Event], metrics: Any, started: float,
                   queued: Optional[Queued] = None) -> AsyncIterator[Event]:
    """``events`` as they come, observed in ``metrics`` (a ``FrontMetrics``
    or None) from ``started`` (``time.monotonic()`` when the request came);
    ``queued`` is done at the first token."""
    if metrics is None:
        async for event in events:
            yield event
        return
    metrics.running.inc()
    first = True
    try:
        async for event in events:
            if first and isinstance(event, (Text, Reasoning, ToolCall)):
                metrics.first_token.observe(time.monotonic() - started)
                first = False
                if queued is not None:
                    queued.done()
            if isinstance(event, Usage):
                metrics.count_usage({"prompt_tokens": event.prompt_tokens,
                                     "completion_tokens": event.completion_tokens})
            yield event
    finally:
        if queued is not None:
            queued.done()
        metrics.running.dec()
        metrics.latency.observe(time.monotonic() - started)
