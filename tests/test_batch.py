"""``mlxdist.batch.batch_generate``: mlx-lm's ``batch_generate`` with token ids
and log-probabilities, read once at the end instead of per sequence per step:
the same result, value for value."""

from mlx_lm import load
from mlx_lm.generate import batch_generate as mlx_lm_batch_generate

from mlxdist.engine.batch import batch_generate

PROMPTS = ["The quick brown fox", "Mixture of experts", "a", "one two three four five six"]


def test_same_tokens_texts_and_logprobs_as_mlx_lm(checkpoint):
    model, tokenizer = load(str(checkpoint("qwen3_moe")))
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    max_tokens = [9, 4, 12, 7]  # ragged: sequences leave the batch at different steps
    want = mlx_lm_batch_generate(model, tokenizer, prompts, max_tokens=max_tokens, completion_batch_size=3,
                                 return_token_ids=True, return_logprobs=True)
    got = batch_generate(model, tokenizer, prompts, max_tokens, completion_batch_size=3)
    assert got.token_ids == want.token_ids
    assert [len(t) for t in got.token_ids] == max_tokens
    assert got.texts == want.texts
    assert got.logprobs == want.logprobs
    assert got.stats.generation_tokens == want.stats.generation_tokens
