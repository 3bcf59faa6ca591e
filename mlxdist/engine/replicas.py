"""A batch run as N replicas (``dispatch/replicas.py``): every rank holds
every expert, so each decodes its own share of the sequences with mlx-lm's
``batch_generate`` alone, as N copies of mlx-lm would, and the ranks meet
once, when all are done:

    rank r takes sequences r, r + N, r + 2N, ...     (as dp admits them)
    batch_generate(its prompts, their samplers)      no collective, no lockstep
    allgather(tokens, log-probabilities, counters)   over the control plane, once

A rank that finishes first waits only at the end; no step of one waits for
another's. A rank whose share fails says so at that gather: the generation
fails on every rank alike (``StepFailed``) and the job goes on. Each
sequence samples from its own keys (``sampling.py``), so a seeded batch
draws the same tokens as in every other mode wherever the logits agree.
"""

from typing import Callable, List

from mlx_lm.generate import BatchResponse
from mlx_lm.generate_utils import BatchStats

from mlxdist.engine.batch import batch_generate
from mlxdist.errors import one_line
from mlxdist.runtime.agreement import agree
from mlxdist.runtime.watchdog import ACTIVITY

__all__ = ["generate_own_share"]


def generate_own_share(engine, prompts: List[List[int]], max_tokens: List[int], samplers: List[Callable],
                       batch_size: int, prefill_step_size: int, max_kv_size=None) -> BatchResponse:
    """Every sequence's tokens and sampled-token log-probabilities on every
    rank, in the order of ``prompts``; the counters are the ranks' summed
    tokens over the slowest rank's times (tokens per second of the whole
    job). ``batch_size``: sequences decoded at once in all, shared over the ranks."""
    world = engine.world
    mine = list(range(world.rank, len(prompts), world.size))
    share = -(-batch_size // world.size)
    tokens, logprobs, counters, error = [], [], {}, None
    if mine:
        try:
            response = batch_generate(engine.model, engine.tokenizer, [prompts[i] for i in mine],
                                      max_tokens=[max_tokens[i] for i in mine], samplers=[samplers[i] for i in mine],
                                      prefill_step_size=prefill_step_size, max_kv_size=max_kv_size,
                                      completion_batch_size=share, prefill_batch_size=share)
        except Exception as e:  # noqa: BLE001 - this rank's share alone: every rank hears of it at the gather
            error = one_line(e)
        else:
            tokens, logprobs, s = response.token_ids, response.logprobs, response.stats
            counters = {"prompt_tokens": s.prompt_tokens, "prompt_time": s.prompt_time,
                        "generation_tokens": s.generation_tokens, "generation_steps": s.generation_steps,
                        "decode_time": s.decode_time, "wall_time": s.wall_time, "peak_memory": s.peak_memory}
    ACTIVITY.at("shares")  # a rank done first waits here for as long as the others decode: not a hang
    shares = agree(world, {"tokens": tokens, "logprobs": logprobs, "counters": counters}, error,
                      failed="generation failed: ")
    token_ids: List[List[int]] = [[] for _ in prompts]
    picked: List[List[float]] = [[] for _ in prompts]
    for rank, got in enumerate(shares):
        for j, i in enumerate(range(rank, len(prompts), world.size)):
            token_ids[i], picked[i] = got["tokens"][j], got["logprobs"][j]
    return BatchResponse([engine.tokenizer.decode(t) for t in token_ids], _combined([g["counters"] for g in shares]),
                         None, token_ids, picked)


def _combined(counters: List[dict]) -> BatchStats:
    """The job's counters: tokens summed, times and peak memory the largest of any rank."""
    found = [c for c in counters if c]
    total = lambda name: sum(c[name] for c in found)  # noqa: E731
    slowest = lambda name: max((c[name] for c in found), default=0.0)  # noqa: E731
    return BatchStats(prompt_tokens=total("prompt_tokens"), prompt_time=slowest("prompt_time"),
                      generation_tokens=total("generation_tokens"), generation_steps=slowest("generation_steps"),
                      decode_time=slowest("decode_time"), wall_time=slowest("wall_time"),
                      peak_memory=slowest("peak_memory"))
