"""Distributed greedy generation equals single-process mlx-lm, token for token
and logit for logit, for every architecture, dispatch mode, quantization and
world size. mlxdist runs for real under mpirun (one launch per world size,
shared by the session's test modules, loads every checkpoint in turn in
every mode: shared_launch.py); the reference is mlx-lm's own
stream_generate in this process."""

import json

import numpy as np
import pytest

from conftest import ROOT, last_json, launch
from shared_launch import declare, result

PROMPT = "The quick brown fox jumps over the lazy dog because"
MAX_TOKENS = 10
ARCHS = ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"]
CHECKPOINTS = [(a, b) for a in ARCHS for b in (None, 4)]
# "collective" is the default, masked layout; "collective-compact" computes
# owned slots only (layout="compact").
WORLDS = [
    ("collective", 1),
    *[(d, n) for d in ("collective", "p2p") for n in (2, 3, 4)],
    ("collective-compact", 2),
    ("collective-compact", 3),
]

TP_ARCHS = ["qwen3_moe", "deepseek_v3", "gpt_oss"]  # mlx-lm has shard() for these
# test_sampling_with_a_seed_is_the_same_on_every_world_size: its request, and its mode per world size
SAMPLING = json.dumps({"max_tokens": 16, "temp": 0.9, "top_p": 0.95, "seed": 7})
SAMPLED = {2: "collective", 3: "p2p"}

_REFERENCE = {}


def reference(path):
    """Tokens and per-step log-probabilities from mlx-lm alone (once per checkpoint, a path or its str)."""
    path = str(path)
    if path not in _REFERENCE:
        import mlx.core as mx
        from mlx_lm import load
        from mlx_lm.generate import stream_generate

        model, tokenizer = load(str(path))
        prompt = tokenizer.encode(PROMPT)
        steps = list(stream_generate(model, tokenizer, mx.array(prompt), max_tokens=MAX_TOKENS))
        _REFERENCE[path] = ([s.token for s in steps], np.stack([np.array(s.logprobs) for s in steps]))
    return _REFERENCE[path]


def generated(dispatch, layout, max_tokens, checkpoints):
    """A generate_each run of PROMPT on ``checkpoints`` ((arch, bits) pairs),
    for ``shared_launch.declare``; read as {path: (tokens, logprobs, num_ranks)}."""

    def make(checkpoint, tmp_path_factory):
        paths = [str(checkpoint(a, b)) for a, b in checkpoints]
        out = tmp_path_factory.mktemp(f"{dispatch}-{layout}")

        def read(summary):
            return {p: (s["tokens"], np.load(out / f"{s['index']}.npy"), s["num_ranks"]) for p, s in summary.items()}

        return ("generate_each", [out, dispatch, layout, PROMPT, max_tokens, *paths]), read

    return make


def one_prompt_batch(dispatch):
    """batch_each's one-prompt batch (max_tokens [12]) on qwen3_moe, for ``shared_launch.declare``."""
    return lambda checkpoint, _: (("batch_each", [dispatch, "masked", "12", 0, 2048, checkpoint("qwen3_moe")]),
                                  lambda got: got)


def _declare() -> None:
    """This module's runs, in the session's launches (shared_launch.py)."""
    for mode, nranks in WORLDS:
        dispatch, _, layout = mode.partition("-")
        declare(__name__, nranks, f"exact {mode}", generated(dispatch, layout or "masked", MAX_TOKENS, CHECKPOINTS))
    for nranks, dispatch in SAMPLED.items():
        declare(__name__, nranks, "exact sampled", generated(dispatch, "default", SAMPLING, [("qwen3_moe", 4)]))
    declare(__name__, 2, "exact collective-tp",  # the command line's layout
            generated("collective-tp", "default", MAX_TOKENS, [(a, None) for a in TP_ARCHS]))
    for dispatch in ("collective", "p2p"):
        declare(__name__, 2, f"exact batch-{dispatch}", one_prompt_batch(dispatch))


_declare()


@pytest.fixture
def distributed(request):
    """(mode, nranks) -> the result of that run declared above, from the
    session's launch at nranks ranks (shared_launch.py): a mode of WORLDS,
    "sampled", "collective-tp" (generate_each's, {path: (tokens, logprobs,
    num_ranks)}), or "batch-collective" / "batch-p2p" (batch_each's)."""
    return lambda mode, nranks: result(request, nranks, f"exact {mode}")


@pytest.mark.parametrize("dispatch,nranks", WORLDS)
@pytest.mark.parametrize("arch,bits", CHECKPOINTS)
def test_matches_mlx_lm(checkpoint, distributed, arch, bits, dispatch, nranks):
    path = checkpoint(arch, bits)
    ref_tokens, ref_logprobs = reference(path)
    tokens, logprobs, num_ranks = distributed(dispatch, nranks)[str(path)]
    assert num_ranks == nranks
    assert tokens == ref_tokens
    assert logprobs.shape == ref_logprobs.shape
    assert np.max(np.abs(logprobs - ref_logprobs)) == 0.0


@pytest.mark.parametrize("dispatch", ["collective", "p2p"])
def test_command_line_matches_mlx_lm(checkpoint, tmp_path, dispatch):
    path = checkpoint("deepseek_v3", 4)
    out = tmp_path / "logprobs.npy"
    proc = launch(
        3,
        ["--model", path, "--prompt", PROMPT, "--max-tokens", MAX_TOKENS, "--json", "--ignore-chat-template",
         "--mode", dispatch, "--logprobs-out", out],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = last_json(proc.stdout)
    ref_tokens, ref_logprobs = reference(path)
    assert result["tokens"] == ref_tokens
    assert result["num_ranks"] == 3 and len(result["peak_memory_gb"]) == 3
    assert np.max(np.abs(np.load(out) - ref_logprobs)) == 0.0


def test_runs_without_mpirun(checkpoint):
    path = checkpoint("qwen3_moe")
    proc = launch(0, ["--model", path, "--prompt", PROMPT, "--max-tokens", MAX_TOKENS, "--json", "--ignore-chat-template"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert last_json(proc.stdout)["tokens"] == reference(path)[0]


def test_prompts_from_stdin_keep_the_model_loaded(checkpoint):
    path = checkpoint("qwen3_moe")
    proc = launch(2, ["--model", path, "--max-tokens", MAX_TOKENS, "--json", "--ignore-chat-template"],
                  input=f"{PROMPT}\n\n{PROMPT}\n")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    assert len(results) == 2
    for line in results:
        assert json.loads(line)["tokens"] == reference(path)[0]


@pytest.mark.parametrize("arch", TP_ARCHS)
def test_collective_tp_is_close_to_mlx_lm(checkpoint, distributed, arch):
    """Attention and dense layers tensor parallel: not bit-exact (the sums run
    in another order), but the same tokens and logits within float noise."""
    path = checkpoint(arch)
    tokens, logprobs, num_ranks = distributed("collective-tp", 2)[str(path)]
    ref_tokens, ref_logprobs = reference(path)
    assert num_ranks == 2
    assert tokens == ref_tokens
    assert np.max(np.abs(logprobs - ref_logprobs)) < 1e-4


def test_collective_tp_needs_mlx_lm_shard(checkpoint):
    proc = launch(2, ["--model", checkpoint("mixtral"), "--prompt", PROMPT, "--mode", "collective-tp"])
    assert proc.returncode != 0
    assert "mixtral has no tensor-parallel shard() in mlx-lm" in proc.stderr


def test_sampling_with_a_seed_is_the_same_on_every_world_size(checkpoint, distributed):
    """temp > 0: every rank that samples draws the same token (same logits,
    same seed), so the result does not depend on N or the mode: the command
    line alone, and the API at np 2 (collective) and 3 (p2p)."""
    path = checkpoint("qwen3_moe", 4)
    sampling = json.loads(SAMPLING)
    proc = launch(0, ["--model", path, "--prompt", PROMPT, "--max-tokens", sampling["max_tokens"], "--json", "--temp",
                      sampling["temp"], "--top-p", sampling["top_p"], "--seed", sampling["seed"],
                      "--ignore-chat-template", "--mode", "collective"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [last_json(proc.stdout)["tokens"]] + [distributed("sampled", n)[str(path)][0] for n in SAMPLED]
    assert results[0] == results[1] == results[2]
    assert results[0][:MAX_TOKENS] != reference(path)[0]  # it really sampled


@pytest.mark.skipif(not (ROOT / ".venv/bin/python").exists(), reason="launch/mpirun uses the project's .venv")
def test_launch_mpirun_wrapper_passes_stdin_and_exit_status(checkpoint):
    import subprocess

    path = checkpoint("qwen3_moe")
    wrapper = [str(ROOT / "launch/mpirun"), "-np", "2", "python", "-m", "mlxdist.run", "--model", str(path), "-m", "4"]
    ok = subprocess.run([*wrapper, "--json"], input="one\ntwo\n", capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert len([l for l in ok.stdout.splitlines() if l.startswith("{")]) == 2
    bad = subprocess.run([*wrapper, "--prompt", "x", "--temp", "-1"], stdin=subprocess.DEVNULL, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode != 0 and "temperature must be >= 0" in bad.stderr


def test_negative_zero_survives_the_exchange():
    """Slots a rank does not compute add -0.0, the identity for every value:
    a -0.0 another rank computed stays -0.0 (with +0.0 it would not)."""
    proc = launch(2, [ROOT / "tests/scripts/signed_zero.py"], module=None)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert last_json(proc.stdout) == {"masked": True, "compact": True}


@pytest.mark.parametrize("dispatch", ["collective", "p2p"])
def test_one_prompt_batch_matches_mlx_lm(checkpoint, distributed, dispatch):
    """``run_batch`` of a single prompt with a list of max_tokens: one batch
    response, stopping at its max_tokens (it once streamed without end)."""
    import sys

    sys.path.insert(0, str(ROOT / "tests/scripts"))
    from batch_each import PROMPTS
    from mlx_lm import load
    from mlx_lm.generate import batch_generate

    path = str(checkpoint("qwen3_moe"))
    got = distributed(f"batch-{dispatch}", 2)[path]
    model, tokenizer = load(path)
    ref = batch_generate(model, tokenizer, [tokenizer.encode(PROMPTS[0])], max_tokens=[12], return_token_ids=True,
                         return_logprobs=True)
    assert got["tokens"] == ref.token_ids
    assert got["logprobs"] == ref.logprobs
