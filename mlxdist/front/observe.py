"""What an agent API's answer (``messages.py``, ``responses.py``) adds to
the front's metrics (``metrics.py``), as the front's own routes add theirs:
its usage to the token counters, the time to its first token, its whole
time, and it counted as running meanwhile.

    async for event in observed(events, metrics, started): ...   # metrics None: events as they are
"""

import time
from typing import Any, AsyncIterator

from mlxdist.front.translate import Event, Reasoning, Text, ToolCall, Usage


async def observed(events: AsyncIterator[Event], metrics: Any, started: float) -> AsyncIterator[Event]:
    """``events`` as they come, observed in ``metrics`` (a ``FrontMetrics``
    or None) from ``started`` (``time.monotonic()`` when the request came)."""
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
            if isinstance(event, Usage):
                metrics.count_usage({"prompt_tokens": event.prompt_tokens,
                                     "completion_tokens": event.completion_tokens})
            yield event
    finally:
        metrics.running.dec()
        metrics.latency.observe(time.monotonic() - started)
