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
from mlxdist.errors import MlxdistError, RankLost, describe_errors, keep_traceback, one_line, say_error
from mlxdist.runtime.watchdog import ACTIVITY
from mlxdist.runtime.world import World, abort


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


def stop_job(world: World, error: BaseException) -> None:
    """End every rank now with one line naming this rank and ``error`` and
    where its traceback went, as ``world.run_or_abort`` does. Called in ``except``."""
    path = keep_traceback(world.rank)
    where = f" (traceback: {path})" if path else ""
    say_error(f"{failure_line(world.rank, error)}{where}")
    abort(world, 1)


def failure_line(rank: int, error: BaseException) -> str:
    """``rank R: Type: first line``: how a rank that ends the job names itself and the cause."""
    text = one_line(error)
    return f"rank {rank}: {text if not isinstance(error, MlxdistError) else f'{type(error).__name__}: {text}'}"
