"""Long prompts at N = 2: under ``collective`` a prefill chunk's attention is
split by heads over the ranks (model/head_split.py) and the generation stays
bit-identical to mlx-lm in one process, prefilled in the same chunks; where
the ranks do not run every head on the same rows (collective-tp's split
model, p2p's workers) nothing is split. One launch shared with the session's
other N = 2 runs (shared_launch.py)."""

import json

import numpy as np
import pytest

from shared_launch import declare, result

PROMPT_TOKENS = 1100  # prefilled as 512 + 512 + 75 (+ 1 with the first step): two chunks split, one not
PREFILL_STEP = 512
MAX_TOKENS = 4
EXACT = [("qwen3_moe", None), ("qwen3_moe", 4), ("deepseek_v3", 4), ("gpt_oss", 4), ("mixtral", None)]
RUNS = {  # run -> (mode, layout, checkpoints)
    "collective": ("collective", "default", EXACT),
    "collective-masked": ("collective", "masked", [("qwen3_moe", 4)]),
    "p2p": ("p2p", "default", [("qwen3_moe", 4)]),
    "collective-tp": ("collective-tp", "default", [("qwen3_moe", None)]),
}


def _make(mode, layout, checkpoints):
    def make(checkpoint, tmp_path_factory):
        paths = [str(checkpoint(a, b)) for a, b in checkpoints]
        out = tmp_path_factory.mktemp(f"long-{mode}-{layout}")

        def read(summary):
            return {p: (s["tokens"], np.load(out / f"{s['index']}.npy"), s["split_chunks"]) for p, s in summary.items()}

        return ("long_prompt_each", [out, mode, layout, PROMPT_TOKENS, PREFILL_STEP, MAX_TOKENS, *paths]), read

    return make


for _name, (_mode, _layout, _checkpoints) in RUNS.items():
    declare(__name__, 2, f"long prompt {_name}", _make(_mode, _layout, _checkpoints))

_REFERENCE = {}


def reference(path):
    """mlx-lm alone on the same prompt, prefilled in the same chunks: tokens and [steps, vocab] log-probabilities."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import stream_generate

    from scripts.long_prompt_each import prompt_ids

    path = str(path)
    if path not in _REFERENCE:
        model, tokenizer = load(path)
        vocab = json.loads((__import__("pathlib").Path(path) / "config.json").read_text())["vocab_size"]
        steps = list(stream_generate(model, tokenizer, mx.array(prompt_ids(vocab, PROMPT_TOKENS)),
                                     max_tokens=MAX_TOKENS, prefill_step_size=PREFILL_STEP))
        _REFERENCE[path] = ([s.token for s in steps], np.stack([np.array(s.logprobs) for s in steps]))
    return _REFERENCE[path]


def _layers(path) -> int:
    return json.loads((__import__("pathlib").Path(path) / "config.json").read_text())["num_hidden_layers"]


@pytest.mark.parametrize("arch,bits", EXACT)
def test_collective_splits_long_chunks_by_heads_and_stays_exact(request, checkpoint, arch, bits):
    path = checkpoint(arch, bits)
    tokens, logprobs, split_chunks = result(request, 2, "long prompt collective")[str(path)]
    ref_tokens, ref_logprobs = reference(path)
    assert split_chunks == 2 * _layers(path)  # the two chunks of 512 in every layer; not the 75, not a decode step
    assert tokens == ref_tokens
    assert np.max(np.abs(logprobs - ref_logprobs)) == 0.0


def test_masked_layout_splits_too(request, checkpoint):
    path = checkpoint("qwen3_moe", 4)
    tokens, logprobs, split_chunks = result(request, 2, "long prompt collective-masked")[str(path)]
    ref_tokens, ref_logprobs = reference(path)
    assert split_chunks == 2 * _layers(path)
    assert tokens == ref_tokens and np.max(np.abs(logprobs - ref_logprobs)) == 0.0


@pytest.mark.parametrize("run", ["p2p", "collective-tp"])
def test_nothing_is_split_where_ranks_do_not_hold_every_head_on_the_same_rows(request, checkpoint, run):
    arch, bits = RUNS[run][2][0]
    path = checkpoint(arch, bits)
    tokens, logprobs, split_chunks = result(request, 2, f"long prompt {run}")[str(path)]
    ref_tokens, ref_logprobs = reference(path)
    assert not split_chunks  # p2p: rank 0 alone runs attention; collective-tp: shard() split the heads already
    assert tokens == ref_tokens
    assert np.max(np.abs(logprobs - ref_logprobs)) <= (0.0 if run == "p2p" else 1e-4)
