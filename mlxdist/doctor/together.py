"""The doctor's steps in lockstep, as a load's: what each rank's probe found,
or why it failed, is gathered through ``runtime/agreement.agree``, so a
probe that fails on one rank (a dangling weight file, an unreadable
``/proc/meminfo``) fails the step on every rank at the same agreement, with
each failing rank's line, and no rank waits for another. Ping-pongs, which
end in MLX's own send and receive, call ``failed_together`` instead (a peer
inside them cannot hear an agreement)."""

from typing import Any, Callable, List

from mlxdist.errors import one_line
from mlxdist.runtime.agreement import agree


def gathered(world, what: str, probe: Callable[[], Any]) -> List[Any]:
    """Every rank's ``probe()`` (JSON-able), in rank order, on every rank.
    Where it raised on any rank: ``StepFailed`` on every rank, whose
    ``rank_errors[r]`` reads "``what``: Type: message" for each rank r it
    raised on (None for the others)."""
    try:
        value, error = probe(), None
    except Exception as e:  # noqa: BLE001 - any failure is this rank's report
        value, error = None, f"{what}: {one_line(e)}"
    return agree(world, value, error, failed="")
