"""Test-only fault injection: ``MLXDIST_FAULT``, one fault or several
separated by ``;``.

- At a rank's expert step: ``kill:rank=1,layer=2,step=3``,
  ``sleep:rank=1,layer=2,step=3,seconds=60`` or ``raise:...`` (an unexpected
  exception) (``layer=-1``: at every MoE layer of that step; ``skip=K``: the
  (K+1)-th time, i.e. in a later generation; ``rank=all``: on every rank).
- ``sequence:max_tokens=13,step=3``: on every rank (or ``rank=R`` alone), the
  server's per-sequence code (sampler, logits processors, detokenizer) of
  each request whose ``max_tokens`` is 13 raises once it has 3 tokens
  (``serving/isolation.py``); ``stall:max_tokens=13,step=3,seconds=60``
  sleeps there instead, once a process: the job holds that request (and
  the requests queued behind it) unfinished, its heartbeat beating.
- ``fail:at=POINT,rank=R``: an unexpected exception at a shared step that is
  not a forward pass (``point``): ``at=place`` while a rank prepares a new
  placement (``layer=L``: at that layer), ``at=page`` in a paging read
  inside a forward pass (``model/paging.py``), ``at=balance`` while rank 0 plans
  the server's new placement, ``at=split`` while a rank times the expert
  cuts at load (``--expert-split auto``), ``at=load`` at a step of a load
  (``op=read``: before the checkpoint is read, ``experts``: before the
  experts are, ``measure``: while ``auto`` times the dense layers),
  ``at=command`` in a control command's own work (``op=stats`` or
  ``probe``: that one only); once, after ``skip=K`` matching moments.

Unset (every real run), ``arm`` leaves ``FAULT`` None and the hot path's one
check, ``if faults.FAULT is not None``, is all it costs; ``point`` runs at
steps taken a few times per generation or placement, never per layer.
"""

import os
import signal
import time
from typing import Dict, List, Optional, Tuple

from mlxdist import envs
from mlxdist.inputs.digits import parse_int, parse_number
from mlxdist.errors import BadVariable


class Fault:
    """One test-only fault of ``MLXDIST_FAULT``, armed if it names this rank."""

    def __init__(self, spec: str, rank: int):
        action, _, params = spec.strip().partition(":")
        values = dict(p.partition("=")[::2] for p in params.split(",") if p)
        self.action = action
        target = values.get("rank", str(rank) if action in _SEQUENCE else "-1")
        try:
            self.armed = target == "all" or parse_int(target, "rank", signed=True) == rank
            self.max_tokens = parse_int(values.get("max_tokens", "-1"), "max_tokens", signed=True)
            self.layer = parse_int(values.get("layer", "-1"), "layer", signed=True)
            self.step = parse_int(values.get("step", "0"), "step")
            self.seconds = parse_number(values.get("seconds", "3600"), "seconds", low=0)
            self.skip = parse_int(values.get("skip", "0"), "skip")  # matching moments to let pass first
        except ValueError as e:
            raise BadVariable(f"the environment variable MLXDIST_FAULT: {spec.strip()[:60]!r}: {e}") from None
        self.at = values.get("at")  # fail: the shared step
        self.op = values.get("op")  # fail at=command: the command

    def maybe_fire(self, layer: int, step: int) -> None:
        if not self.armed or self.action in (*_SEQUENCE, "fail") or self.layer not in (layer, -1) or step != self.step:
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
        """The ``sequence`` or ``stall`` fault, in the per-sequence code ``where`` of a served request."""
        if self.action not in _SEQUENCE or max_tokens != self.max_tokens or tokens < self.step:
            return
        if self.action == "sequence":
            raise RuntimeError(f"injected fault in a sequence's {where} at token {tokens}")
        if self.armed:
            self.armed = False  # once
            time.sleep(self.seconds)

    def maybe_fail(self, at: str, layer: Optional[int], op: Optional[str]) -> None:
        """The ``fail`` fault, at the shared step ``at``."""
        if (not self.armed or self.action != "fail" or self.at != at or self.layer not in (-1, layer)
                or self.op not in (None, op)):
            return
        if self.skip > 0:
            self.skip -= 1
            return
        self.armed = False  # once
        where = f" (layer {layer})" if layer is not None else f" ({op})" if op else ""
        raise RuntimeError(f"injected fault at {at}{where}")


_SEQUENCE = ("sequence", "stall")  # the faults of a served request's per-sequence code
FAULT: Optional[Fault] = None  # this rank's first armed fault at expert steps or sequences; None in real runs
_ARMED: List[Fault] = []  # all of them, each fired at its own moment
_POINTS: Dict[Tuple[int, str], List[Fault]] = {}  # (rank, MLXDIST_FAULT) -> its ``fail`` faults: each fires once a process
_RANK = 0  # this process's rank, as ``arm`` was told


def _parse(rank: int) -> List[Fault]:
    spec = envs.get("MLXDIST_FAULT")
    return [Fault(s, rank) for s in spec.split(";") if s.strip()] if spec else []


def arm(rank: int) -> Optional[Fault]:
    """Arm the faults ``MLXDIST_FAULT`` sets for this rank's expert steps or
    sequences, if any (at start-up); the first of them, or None."""
    global FAULT, _RANK
    _RANK = rank
    _ARMED[:] = [f for f in _parse(rank) if f.armed and f.action != "fail"]
    FAULT = _ARMED[0] if _ARMED else None
    return FAULT


def at_layer(layer: int, step: int) -> None:
    """Fire each armed fault whose moment this is (callers check ``FAULT`` first)."""
    for fault in _ARMED:
        fault.maybe_fire(layer, step)


def point(at: str, rank: Optional[int] = None, layer: Optional[int] = None, op: Optional[str] = None) -> None:
    """Raise the ``fail`` fault armed for ``rank`` (default: the one ``arm``
    was given) at the shared step ``at``, if this is its moment."""
    rank = _RANK if rank is None else rank
    key = (rank, envs.get("MLXDIST_FAULT"))
    if key not in _POINTS:
        _POINTS[key] = [f for f in _parse(rank) if f.armed and f.action == "fail"]
    for fault in _POINTS[key]:
        fault.maybe_fail(at, layer, op)
