"""mlx-lm's ``batch_generate``, its sampled tokens' log-probabilities read
without a host wait per sequence.

mlx-lm's ``batch_generate(return_logprobs=True)`` reads each sequence's
log-probability with ``.item()`` as each step's tokens come back. On a GPU
that indexing runs behind the step already in flight, so the host waits for
that whole step, once per step, and cannot build the next one meanwhile
(``python -m mlxdist.bench one-rank`` shows the cost beside mlx-lm's plain
call: "mlx-lm with logprobs"). Here each step's picks are gathered into one
array that is started (``mx.async_eval``) and read once the generation ends.
The values are mlx-lm's own (the same rows, indexed the same way).
"""

from typing import List, Optional

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, BatchResponse


def batch_generate(model, tokenizer, prompts: List[List[int]], max_tokens, samplers: Optional[List] = None,
                   **kwargs) -> BatchResponse:
    """``mlx_lm.generate.batch_generate(..., return_token_ids=True,
    return_logprobs=True)``, the same result; ``samplers`` (one per prompt,
    None: the generator's) go to ``BatchGenerator.insert``, ``kwargs`` to
    ``BatchGenerator``."""
    gen = BatchGenerator(model, stop_tokens=[[t] for t in tokenizer.eos_token_ids], **kwargs)
    if isinstance(max_tokens, int):
        max_tokens = [max_tokens] * len(prompts)
    uids = gen.insert(prompts, max_tokens, samplers=samplers)
    tokens = {uid: [] for uid in uids}
    picks = []  # per step: ([uid, ...], [n] log-probabilities of the tokens sampled, started)
    with gen.stats() as stats:
        while responses := gen.next_generated():
            kept = [r for r in responses if r.finish_reason != "stop"]
            for r in kept:
                tokens[r.uid].append(r.token)
            if kept:
                # A one-element slice per row, then one concatenate: the fewest graph nodes (a
                # decode step on a GPU is bound by the host's time per node).
                chosen = mx.concatenate([r.logprobs[r.token : r.token + 1] for r in kept])
                mx.async_eval(chosen)
                picks.append(([r.uid for r in kept], chosen))
    gen.close()
    logprobs = {uid: [] for uid in uids}
    for step_uids, chosen in picks:
        for uid, value in zip(step_uids, chosen.tolist()):
            logprobs[uid].append(value)
    return BatchResponse([tokenizer.decode(tokens[uid]) for uid in uids], stats, None,
                         [tokens[uid] for uid in uids], [logprobs[uid] for uid in uids])
