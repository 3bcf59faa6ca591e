"""How long the server's batch steps take on rank 0: a histogram the rank
server's ``/health`` reports (``step_seconds``) and the front's ``/metrics``
turns into ``mlxdist_step_seconds``. A step is one ``BatchGenerator.next()``
of mlx-lm's loop (a prefill chunk or one decode token for every sequence in
the batch), timed between two calls of the loop's budget
(``lockstep._ProgressBudget``).
"""

import threading
from typing import Dict, List, Union

STEP_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24)


class StepTimes:
    """Counts of steps by upper bound (seconds), their sum and number."""

    def __init__(self, buckets=STEP_BUCKETS):
        self.buckets = tuple(buckets)
        self._counts = [0] * (len(self.buckets) + 1)  # the last: above every bound
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        index = next((i for i, bound in enumerate(self.buckets) if seconds <= bound), len(self.buckets))
        with self._lock:
            self._counts[index] += 1
            self._sum += seconds

    def as_json(self) -> Dict[str, Union[List[float], List[int], float, int]]:
        """``{"buckets": bounds, "counts": steps at or below each bound
        (cumulative, as Prometheus counts them), "sum": seconds, "count": steps}``."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, running = [], 0
        for count in counts[:-1]:
            running += count
            cumulative.append(running)
        return {"buckets": list(self.buckets), "counts": cumulative, "sum": total, "count": sum(counts)}


STEPS = StepTimes()  # this process's (rank 0's server loop)
