"""Re-placing experts while the server runs (``--rebalance-every``).

Rank 0 decides when (at most every ``every`` seconds, once enough slots were
routed since the last placement), and says so in the lockstep loop's shared
message; every rank then, at that same message between two batch steps:

1. lets the step in flight finish (it computed with the old placement,
   whose weights are the same: its results are the same);
2. gathers every rank's routed-slot counts (``routing_share``) and takes
   those since the last placement;
3. receives rank 0's balanced placement of them (``model/balance.py``);
4. holds it (``Engine.place``): reads the experts it newly holds
   from its own checkpoint copy, keeps the others, and the next step uses it
   on every rank.

Nothing in flight is dropped and results do not change; serving pauses for
the time the ranks take to read their new experts (logged on rank 0). A
failure at any stage on any rank (counting, planning on rank 0, reading
new experts) travels on that stage's message: every rank keeps the old
placement and serving goes on.
"""

import collections
import json
import logging
import time
from typing import Deque, Dict, List, Optional

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generation_stream

from mlxdist.dispatch.stats import add_shares, routing_share
from mlxdist.engine import Engine
from mlxdist.errors import MlxdistError, StepFailed, one_line
from mlxdist.model.balance import balanced, imbalance
from mlxdist.values.placement import Placement
from mlxdist.runtime import faults
from mlxdist.runtime.agreement import agree
from mlxdist.runtime.watchdog import ACTIVITY
from mlxdist.runtime.world import World

KEPT = 100  # rebalances remembered, and failures
MIN_SLOTS_PER_EXPERT = 4  # routed slots since the last placement, on average, before re-placing on them


class Rebalancer:
    """When and how to re-place this server's experts."""

    def __init__(self, world: World, engine: Engine, every: float, duplicates: int = 0,
                 budgets: Optional[List[float]] = None):
        self.world = world
        self.engine = engine
        self.every = every
        self.duplicates = duplicates
        self.budgets = budgets
        self.last = time.monotonic()
        self.baseline: Dict[int, np.ndarray] = {}  # counts at the last placement
        # The latest rebalances (a server runs for days): seconds, imbalance before / after; and one
        # line per rebalance that failed on some rank (the old placement kept).
        self.history: Deque[Dict[str, float]] = collections.deque(maxlen=KEPT)
        self.failures: Deque[str] = collections.deque(maxlen=KEPT)

    def due(self) -> bool:
        """On rank 0, at each shared message: whether to re-place now."""
        return time.monotonic() - self.last >= self.every

    def run(self) -> Optional[Placement]:
        """On every rank at the same shared message (see the module's docstring).
        Returns the new placement, or None where too few slots were routed
        or any rank failed at any stage (logged; the old placement stays on
        every rank: each stage's failure travels on that stage's own message)."""
        tic = time.perf_counter()
        self.last = time.monotonic()
        mx.synchronize(generation_stream)
        mx.synchronize()
        engine, world = self.engine, self.world
        share, error = None, None
        try:
            share = {str(l): c.tolist() for l, c in routing_share(engine.dispatchers.values(), world.rank).items()}
        except Exception as e:  # noqa: BLE001 - carried on the gather below
            error = one_line(e)
        try:
            shares = agree(world, share, error)
        except StepFailed as e:  # on every rank alike
            return self._not_placed(str(e))
        totals = add_shares(shares)
        recent = {l: np.asarray(c) - self.baseline.get(l, 0) for l, c in totals.items()}
        experts = sum(c.size for c in recent.values())
        if not recent or sum(int(c.sum()) for c in recent.values()) < MIN_SLOTS_PER_EXPERT * experts:
            return None
        payload = None
        if world.is_root:
            payload = json.dumps(self._plan(recent)).encode()
        message = json.loads(world.control.bcast_bytes(payload))
        if "error" in message:
            return self._not_placed(message["error"])
        try:  # the same plan on every rank: from_json fails everywhere alike; Engine.place agrees on its own
            plan = Placement.from_json(message["placement"])
            seconds = engine.place(plan)  # all or nothing
        except MlxdistError as e:
            return self._not_placed(one_line(e))
        ACTIVITY.progress()
        self.baseline = {l: np.asarray(c) for l, c in totals.items()}
        took = time.perf_counter() - tic
        self.history.append({"seconds": took, "load_seconds": seconds, "before": message["before"],
                             "after": message["after"]})
        if world.is_root:
            logging.warning("experts placed again in %.3f s: predicted imbalance %.3f -> %.3f",
                            took, message["before"], message["after"])
        return plan

    def _plan(self, recent: Dict[int, np.ndarray]) -> Dict:
        """On rank 0: the balanced placement of ``recent`` and its predicted
        imbalance, or the error that stopped it (sent to every rank alike)."""
        try:
            faults.point("balance", self.world.rank)
            counts = {l: c.tolist() for l, c in recent.items()}
            plan = balanced(counts, self.world.size, self.duplicates, self.budgets)
            return {"placement": plan.to_json(), "before": imbalance(self.engine.placement, counts),
                    "after": imbalance(plan, counts)}
        except Exception as e:  # noqa: BLE001 - every rank keeps the old placement
            return {"error": f"rank 0: {one_line(e)}"}

    def _not_placed(self, why: str) -> None:
        """Log why nothing was placed this time (the same on every rank)."""
        self.failures.append(why)
        logging.warning("experts not placed again: %s", why)
        return None
