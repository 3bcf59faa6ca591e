"""Test-only fault injection: ``MLXDIST_FAULT``, e.g.
``kill:rank=1,layer=2,step=3``, ``sleep:rank=1,layer=2,step=3,seconds=60`` or
``raise:...`` (an unexpected exception), at that rank's expert step
(``layer=-1``: at every MoE layer of that step; ``skip=K``: the (K+1)-th
time, i.e. in a later generation). ``sequence:max_tokens=13,step=3``: on
every rank (or ``rank=R`` alone), the server's per-sequence code (sampler,
logits processors, detokenizer) of each request whose ``max_tokens`` is 13
raises once it has 3 tokens (``serving/isolation.py``).

Unset (every real run), ``arm`` leaves ``FAULT`` None and the hot path's one
check, ``if faults.FAULT is not None``, is all it costs.
"""

import os
import signal
import time
from typing import Optional

from mlxdist import envs


class Fault:
    """The test-only fault of ``MLXDIST_FAULT``, if it names this rank."""

    def __init__(self, spec: str, rank: int):
        action, _, params = spec.partition(":")
        values = dict(p.split("=", 1) for p in params.split(",") if p)
        self.action = action
        self.armed = int(values.get("rank", rank if action == "sequence" else -1)) == rank
        self.max_tokens = int(values.get("max_tokens", -1))
        self.layer = int(values.get("layer", -1))
        self.step = int(values.get("step", 0))
        self.seconds = float(values.get("seconds", 3600))
        self.skip = int(values.get("skip", 0))  # matching moments to let pass first (later generations)

    def maybe_fire(self, layer: int, step: int) -> None:
        if not self.armed or self.action == "sequence" or self.layer not in (layer, -1) or step != self.step:
            return
        if self.skip > 0:
            self.skip -= 1
            return
        self.armed = self.layer == -1  # every layer of the step
        if self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.action == "raise":
            raise RuntimeError(f"injected fault at layer {layer} of step {step}")
        elif self.action == "sleep":
            time.sleep(self.seconds)

    def maybe_fire_sequence(self, max_tokens: int, tokens: int, where: str) -> None:
        """The ``sequence`` fault, in the per-sequence code ``where`` of a served request."""
        if self.action == "sequence" and max_tokens == self.max_tokens and tokens >= self.step:
            raise RuntimeError(f"injected fault in a sequence's {where} at token {tokens}")


FAULT: Optional[Fault] = None  # this rank's armed fault; None in real runs


def arm(rank: int) -> Optional[Fault]:
    """Arm the fault ``MLXDIST_FAULT`` sets for this rank, if any (at start-up)."""
    global FAULT
    spec = envs.get("MLXDIST_FAULT")
    fault = Fault(spec, rank) if spec else None
    FAULT = fault if fault is not None and fault.armed else None
    return FAULT


def at_layer(layer: int, step: int) -> None:
    """Fire the armed fault if this is its moment (callers check ``FAULT`` first)."""
    if FAULT is not None:
        FAULT.maybe_fire(layer, step)
