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

Steps that are not forward passes (a placement, a control command, the
server's rebalancing) agree instead on the message their ranks already
exchange at that step; see docs/failures.md.
"""

from mlxdist import envs
from mlxdist.errors import RankLost, describe_errors, one_line
from mlxdist.runtime.watchdog import ACTIVITY
from mlxdist.runtime.world import World, stop_job


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
