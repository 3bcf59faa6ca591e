"""Distributed greedy generation equals single-process mlx-lm, token for token
and logit for logit, for every architecture, dispatch mode, quantization and
world size. mlxdist runs for real under mpirun; the reference is mlx-lm's own
stream_generate in this process."""

import json

import numpy as np
import pytest

from conftest import last_json, launch

PROMPT = "The quick brown fox jumps over the lazy dog because"
MAX_TOKENS = 10
ARCHS = ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"]

_REFERENCE = {}


def reference(path):
    """Tokens and per-step log-probabilities from mlx-lm alone."""
    if path not in _REFERENCE:
        import mlx.core as mx
        from mlx_lm import load
        from mlx_lm.generate import stream_generate

        model, tokenizer = load(str(path))
        prompt = tokenizer.encode(PROMPT)
        steps = list(stream_generate(model, tokenizer, mx.array(prompt), max_tokens=MAX_TOKENS))
        _REFERENCE[path] = (
            [s.token for s in steps],
            np.stack([np.array(s.logprobs) for s in steps]),
        )
    return _REFERENCE[path]


def run_distributed(path, nranks, dispatch, tmp_path):
    out = tmp_path / "logprobs.npy"
    proc = launch(
        nranks,
        ["--model", path, "--prompt", PROMPT, "--max-tokens", MAX_TOKENS, "--json",
         "--dispatch", dispatch, "--logprobs-out", out],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return last_json(proc.stdout), np.load(out)


CASES = [(a, b, "collective", 1) for a in ARCHS for b in (None, 4)] + [
    (a, b, d, n)
    for a in ARCHS
    for b in (None, 4)
    for d in ("collective", "p2p")
    for n in (2, 3, 4)
]


@pytest.mark.parametrize("arch,bits,dispatch,nranks", CASES)
def test_matches_mlx_lm(checkpoint, tmp_path, arch, bits, dispatch, nranks):
    path = checkpoint(arch, bits)
    ref_tokens, ref_logprobs = reference(path)
    result, logprobs = run_distributed(path, nranks, dispatch, tmp_path)
    assert result["tokens"] == ref_tokens
    assert result["num_ranks"] == nranks
    assert len(result["peak_memory_gb"]) == nranks
    assert logprobs.shape == ref_logprobs.shape
    assert np.max(np.abs(logprobs - ref_logprobs)) == 0.0


def test_runs_without_mpirun(checkpoint, tmp_path):
    path = checkpoint("qwen3_moe")
    proc = launch(0, ["--model", path, "--prompt", PROMPT, "--max-tokens", MAX_TOKENS, "--json"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert last_json(proc.stdout)["tokens"] == reference(path)[0]


def test_prompts_from_stdin_keep_the_model_loaded(checkpoint):
    path = checkpoint("qwen3_moe")
    proc = launch(2, ["--model", path, "--max-tokens", MAX_TOKENS, "--json"], input=f"{PROMPT}\n\n{PROMPT}\n")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    assert len(results) == 2
    for line in results:
        assert json.loads(line)["tokens"] == reference(path)[0]
