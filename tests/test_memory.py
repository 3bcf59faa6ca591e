"""Per-rank loading: a rank holding 1/N of the experts peaks at no more than
1.25 x (its expert bytes + the dense bytes it holds), during LOAD and during
generation, on a checkpoint whose experts dominate its size. Peak is MLX's own
allocator peak on each rank."""

import pytest

from shared_launch import declare
from shared_launch import result as shared

EXPERT_HEAVY = {"hidden_size": 256, "num_experts": 32, "moe_intermediate_size": 512, "num_hidden_layers": 4}
DISPATCHES = ["p2p", "collective"]
BITS = [None, 4]


def memory_run(dispatch, bits):
    """A generate_each run on the expert-heavy checkpoint, for ``shared_launch.declare``: its summary's entry
    (each rank's peak memory and weights, as the command line's --json gives them)."""

    def make(checkpoint, tmp_path_factory):
        path = checkpoint("qwen3_moe", bits, overrides=EXPERT_HEAVY)
        out = tmp_path_factory.mktemp(f"memory-{dispatch}-{bits}")
        return ("generate_each", [out, dispatch, "default", "memory", 4, path]), lambda summary: summary[str(path)]

    return make


def _declare() -> None:
    """This module's runs, in the session's launch at 4 ranks (shared_launch.py)."""
    for dispatch in DISPATCHES:
        for bits in BITS:
            declare(__name__, 4, f"memory {dispatch} {bits}", memory_run(dispatch, bits))


_declare()


@pytest.mark.parametrize("dispatch", DISPATCHES)
@pytest.mark.parametrize("bits", BITS)
def test_peak_memory_per_rank(request, dispatch, bits):
    """Each case loads in turn on the session's launch at 4 ranks (shared_launch.py): every load and every
    generation measures its own peak, and the model before is released first."""
    result = shared(request, 4, f"memory {dispatch} {bits}")
    held = result["weights_gb"]
    total_experts = sum(h["expert"] for h in held)
    for rank, (h, peak) in enumerate(zip(held, result["peak_memory_gb"])):
        assert h["expert"] == pytest.approx(total_experts / 4, rel=0.01)
        if dispatch == "p2p" and rank > 0:
            assert h["dense"] == 0
        assert peak <= 1.25 * (h["expert"] + h["dense"]), (rank, h, peak)
        # and while loading: the stacked expert tensors are never materialised whole
        assert h["load_peak"] <= 1.25 * (h["expert"] + h["dense"]), (rank, h)
    # The checkpoint really is expert-heavy, so holding 1/4 of it matters.
    dense = held[0]["dense"]
    assert total_experts > 3 * dense
