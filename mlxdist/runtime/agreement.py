"""Failures that never split the ranks: what a rank does when its part of
a shared step (a forward pass, a prefill, a paging read, a batch step of the
server) raises.

The others may be inside that step's collectives, waiting for this rank, or
may have failed at the same point (a failure made by the shared input is
every rank's). The failing rank asks them, outside the collectives, within
``MLXDIST_AGREE_SECONDS`` (``Control.failed_together``):

- every rank failed: the step fails on every rank alike (the request ends
  with an error) and the job goes on;
- some rank did not: it is waiting in a collective this rank will never
  join, so this rank ends the job now with one line naming itself and the
  cause (mpirun then stops the others, each saying where it was).

Steps that are not forward passes (a load, a placement, a control command,
the server's rebalancing) agree instead on the message their ranks already
share at that step (``agree``): each rank's value with its error beside it.
A rank whose own work raised between two agreements sends its error at the
next one it reaches, and the others, wherever that finds them, read it
there: every agreement of a step has the same shape, so the ranks leave the
step together. Work that ends in a collective of MLX's (a timing
of the link, a transfer) catches its own errors first and still joins it;
see docs/failures.md.
"""

from typing import Any, List, Optional

from mlxdist import envs
from mlxdist.errors import RankLost, StepFailed, describe_errors, one_line
from mlxdist.runtime.watchdog import ACTIVITY
from mlxdist.runtime.world import World
from mlxdist.runtime.exits import stop_job


def failed_together(world: World, error: BaseException) -> str:
    """Called in the ``except`` block of a rank whose part of a shared step
    raised ``error``. Returns one line describing every rank's failure where
    all failed; otherwise ends the job (see the module's docstring)."""
    ACTIVITY.progress()  # this wait has its own deadline, shorter than the watchdog's
    try:
        lost = isinstance(error, RankLost)  # a lost rank cannot answer
        messages = None if lost else world.control.failed_together(one_line(error),
                                                                          envs.get("MLXDIST_AGREE_SECONDS"))
    except Exception:  # noqa: BLE001 - a peer gone under MPI: this rank's own error is the report
        messages = None
    if messages is None:
        stop_job(world, error)
    return describe_errors(messages)


def agree(world: World, value: Any, error: Optional[str] = None, failed: str = "",
             raises: type = StepFailed) -> List[Any]:
    """Every rank's ``value`` (JSON-able), gathered on every rank, with this
    rank's ``error`` (one line, or None) beside it. Where any rank's is set,
    ``raises`` on every rank alike: ``failed`` followed by the first error,
    naming the ranks that hit it (see the module's docstring); its
    ``rank_errors`` holds every rank's error (None where it had none), for a
    caller that names each."""
    reports = world.control.allgather_json({"value": value, "error": error})
    errors = [r["error"] for r in reports]
    if any(errors):
        failure = raises(f"{failed}{describe_errors(errors)}")
        failure.rank_errors = errors
        raise failure
    return [r["value"] for r in reports]
