"""Sampling keyed by sequence (engine/sampling.py): under dp each rank
samples its own rows, and before the keys every rank's row i drew the same
noise (copies of one prompt came back in identical pairs). Now each
sequence's draws are its own: copies are independent samples, and with a
seed every mode and every N give the same tokens (float32: dp's logits agree
with the exact modes' within its tolerance, far below what moves a sample)."""

import json

import pytest

from conftest import ROOT, last_json, launch

COPIES, MAX_TOKENS, SEED = 4, 16, 5


@pytest.fixture(scope="module")
def samples(checkpoint):
    """{N: {dispatch: [tokens of each copy]}} for N = 1, 2, 3."""
    path = checkpoint("qwen3_moe")
    out = {}
    for nranks in (1, 2, 3):
        proc = launch(nranks, [ROOT / "tests/scripts/sample_each.py", path, COPIES, MAX_TOKENS, SEED, "dp", "collective"],
                      module=None, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[nranks] = last_json(proc.stdout)
    return out


def test_copies_of_one_prompt_are_independent_samples_under_dp(samples):
    for nranks, by_mode in samples.items():
        tokens = by_mode["dp"]
        assert len({json.dumps(t) for t in tokens}) == COPIES, (nranks, tokens)


def test_seeded_samples_equal_in_every_mode_and_world_size(samples):
    reference = samples[1]["collective"]
    for nranks, by_mode in samples.items():
        assert by_mode["dp"] == reference, nranks
        assert by_mode["collective"] == reference, nranks
    assert all(len(t) == MAX_TOKENS for t in reference)  # it sampled the whole length
