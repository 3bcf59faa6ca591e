"""Per-rank loading: a rank holding 1/N of the experts peaks at no more than
1.25 x (its expert bytes + the dense bytes it holds), during LOAD and during
generation, on a checkpoint whose experts dominate its size. Peak is MLX's own
allocator peak on each rank."""

import pytest

from conftest import last_json, launch

EXPERT_HEAVY = {"hidden_size": 256, "num_experts": 32, "moe_intermediate_size": 512, "num_hidden_layers": 4}


@pytest.mark.parametrize("dispatch", ["p2p", "collective"])
@pytest.mark.parametrize("bits", [None, 4])
def test_peak_memory_per_rank(checkpoint, dispatch, bits):
    path = checkpoint("qwen3_moe", bits, overrides=EXPERT_HEAVY)
    proc = launch(4, ["--model", path, "--prompt", "memory", "-m", 4, "--json", "--dispatch", dispatch])
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = last_json(proc.stdout)
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
