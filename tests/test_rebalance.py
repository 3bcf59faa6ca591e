"""Placing experts again while a job runs: between generations through the
API (``Cluster.place``), and live in the server (``--rebalance-every``),
where every rank switches at the same step between two batch steps. Under
real mpirun on a router-skewed checkpoint; answers do not change."""

import re

import pytest

from shared_launch import declare, result
from test_serve import PROMPTS, Server, alone, clients_answer_as_alone

DISPATCHES = ["collective", "p2p", "dp"]


def _skewed(checkpoint):
    return checkpoint("deepseek_v3", router_skew=2.0)


@pytest.fixture(scope="module")
def skewed(checkpoint):
    return _skewed(checkpoint)


# place_live.py's run of every mode, in the session's launch at 2 ranks (shared_launch.py)
declare(__name__, 2, "rebalance place live",
        lambda checkpoint, _: (("place_live", [_skewed(checkpoint), 8, *DISPATCHES]), lambda got: got))


@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_place_between_generations(request, dispatch):
    got = result(request, 2, "rebalance place live")[dispatch]
    assert got["after"] == got["before"]
    assert got["placed"] and len(got["seconds"]) == 2
    assert any(len(held) > 6 for held in got["held"].values())  # 12 experts, 2 ranks, 1 replica slot each
    assert got["refused"] and "ranks" in got["refused"]


def test_server_rebalances_live_with_clients(skewed):
    """Clients keep sending while the server places its experts again every
    half second: every answer equals mlx-lm's alone, none fails, and the
    server says how long each placement took."""
    expected = {p: alone(skewed, p, 8) for p in PROMPTS}
    s = Server(skewed, extra=["--rebalance-every", "0.5", "--rebalance-duplicates", "1"])
    try:
        clients_answer_as_alone(s, 8, 6, 8, expected)
        clients_answer_as_alone(s, 4, 4, 8, expected)
    finally:
        code = s.stop()
    stderr = s.proc.stderr.read()
    assert code == 0, stderr[-3000:]
    took = [float(t) for t in re.findall(r"experts placed again in ([0-9.]+) s", stderr)]
    assert took, stderr[-3000:]
    assert "lost a rank" not in stderr and "Traceback" not in stderr
