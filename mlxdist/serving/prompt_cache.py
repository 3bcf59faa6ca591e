"""The server's prompt cache: mlx-lm's ``LRUPromptCache`` with every entry
holding exactly the tokens it is kept under.

mlx-lm's server keeps a request's KV cache under its prompt and generated
tokens, and reuses the nearest entry for a later request, trimmed by the
tokens the two do not share: that trim is right only where the cache holds
every token of its key. Plain decoding's does. The speculative loop's does
not (``--draft-model``): the model's cache ends one token short when the
last token was the model's own rather than a kept draft, and the draft
model's layers (the entry's second part) end where its last drafting left
them. A later request then decoded on a cache missing a prompt token and
answered other text than the model's greedy one (``mlx_lm.server`` 0.32.2
does the same). Here an entry is cut, as it is stored, to the tokens every
layer holds (its key to as many), so reuse stays on under a draft and is
exact; an entry whose layers do not say how many tokens they hold is not
kept. A request equal to a whole key gets the entry less its last token, so
that one token is computed (mlx-lm would hand the loop an empty prompt).

Every rank runs the same requests in the same order (``lockstep.py``), so
every rank keeps and cuts the same entries (under ``--mode dp`` each rank
keeps its own sequences': ``dp_prompt_cache.py``).

The cache is bounded in bytes, on each rank (``--prompt-cache-bytes``,
mlx-lm's ``LRUPromptCache(max_bytes=)``: the least recently stored entries
go first) and in entries (mlx-lm's 10). The default, 8 GiB, keeps one long
agent conversation of the models this serves: Qwen3-235B-A22B's KV cache
takes 188 KiB a token (94 layers x 2 x 4 heads x 128 x 2 bytes), so 8 GiB is
44,000 tokens; gpt-oss-120b's 72 KiB (116,000 tokens); and it is a few per
cent of a 128-512 GB Mac beside its share of the weights. 0 keeps nothing.
"""

from typing import Any, List, Optional, Tuple

from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache

from mlxdist.serving.cache_bytes import DEFAULT_PROMPT_CACHE_BYTES, MAX_PROMPT_CACHE_BYTES, prompt_cache_bytes_arg

__all__ = ["AlignedPromptCache", "held_tokens", "prompt_cache_bytes_arg", "DEFAULT_PROMPT_CACHE_BYTES",
           "MAX_PROMPT_CACHE_BYTES", "PROMPT_CACHE_ENTRIES"]

PROMPT_CACHE_ENTRIES = 10  # mlx-lm's server's --prompt-cache-size


def held_tokens(cache: List[Any]) -> Optional[int]:
    """The tokens every layer of ``cache`` holds (the fewest of their
    offsets), or None where a layer does not say."""
    offsets = [getattr(c, "offset", None) for c in cache]
    if not offsets or any(isinstance(o, bool) or not isinstance(o, int) for o in offsets):
        return None
    return min(offsets)


class AlignedPromptCache(LRUPromptCache):
    """``LRUPromptCache`` whose entries hold exactly their key's tokens."""

    def insert_cache(self, model: Any, tokens: List[int], prompt_cache: List[Any], **kwargs) -> None:
        if can_trim_prompt_cache(prompt_cache):
            held = held_tokens(prompt_cache)
            if held is None:
                return  # cannot be cut to its key: not kept
            held = min(held, len(tokens))
            for layer in prompt_cache:
                layer.trim(layer.offset - held)
            tokens = tokens[:held]
            if not tokens:
                return
        super().insert_cache(model, tokens, prompt_cache, **kwargs)

    def fetch_nearest_cache(self, model: Any, tokens: List[int]) -> Tuple[Optional[List[Any]], List[int]]:
        cache, rest = super().fetch_nearest_cache(model, tokens)
        if cache is not None and not rest and tokens and can_trim_prompt_cache(cache):
            trim_prompt_cache(cache, 1)
            rest = tokens[-1:]
        return cache, rest
