"""The benchmark's link emulator (mlxdist/bench/linkemu): every data-moving
MPI call of every rank, MLX's and mpi4py's alike, waits the link's latency
plus its bytes over the bandwidth, once. Checked on two real ranks: each
call costs at least what the link says (the wait happens) and less than
twice that (it is charged once, not by both the library MLX opens and the
one preloaded for mpi4py). The figures are large so that a loaded machine's
own delays stay far below them."""

import pytest

from mlxdist.bench.linkemu import PRESETS, EmulatedLink, measure, parse_link
from mlxdist.errors import UserError

from conftest import mpirun_env

ROUNDS = 10


@pytest.mark.parametrize("link,one_call_us", [
    (EmulatedLink("latency", 50000, 1000), 50000),  # 50 ms a call; bytes cost nothing
    (EmulatedLink("bandwidth", 0, 8192 / 50e6), 50000),  # 8 KiB a call at 164 KB/s: 50 ms
])
def test_every_call_pays_the_link_once(link, one_call_us):
    cost = measure(link, ROUNDS, base_env=mpirun_env())
    assert one_call_us <= cost["mlx_all_sum"] < 2 * one_call_us, cost
    for round_trip in ("mlx_ping_pong", "mpi4py_ping_pong"):  # two sends
        assert 2 * one_call_us <= cost[round_trip] < 4 * one_call_us, (round_trip, cost)


def test_links_are_presets_or_latency_and_bandwidth():
    assert parse_link("10gbe") is PRESETS["10gbe"]
    assert parse_link(" 300,2.5 ") == EmulatedLink("300,2.5", 300.0, 2.5)
    for bad in ("", "fast", "300", "300,0", "-1,2", "nan,2", "1e9,1", "300,abc"):
        with pytest.raises(UserError, match="--link takes a preset"):
            parse_link(bad)
