"""Speculative decoding for one prompt: drafts verified by the distributed
model in one forward pass, so k drafted tokens pay one forward's exchanges.

mlx-lm's ``speculative_generate_step`` runs the loop (draft, verify,
accept, rewind the caches) unchanged; mlxdist supplies the drafter:

- a **draft model** (``--draft-model``): a small model with the same
  tokenizer, loaded whole on every rank that runs the dense model, so the
  draft costs no link traffic (in ``collective`` every rank drafts the same
  tokens from the same cache; in ``p2p`` rank 0 alone);
- **prompt lookup** (``--prompt-lookup-ngram N``): no model; the next tokens
  are those that followed the last occurrence of the latest N-gram in the
  prompt and output so far (``PromptLookup``, a module with mlx-lm's model
  calling convention and a trimmable cache of the tokens seen).

Greedy: a drafted token is kept where the model's own argmax agrees, so the
text is the model's greedy text. Sampling: mlx-lm draws the model's token at
each position and keeps the draft's where they agree: every token is the
model's sample given the tokens before it.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from mlxdist.errors import UserError

__all__ = ["DraftTally", "PromptLookup", "drafter", "drafter_name", "load_draft"]


class TokenHistory:
    """The tokens a ``PromptLookup`` has seen: its KV cache, trimmable as
    mlx-lm rewinds caches, with an index of every n-gram of up to ``ngram``
    tokens to the positions of the tokens that followed it (ascending), so
    that a lookup costs ``ngram`` dictionary reads, not a scan of the context."""

    def __init__(self, ngram: int = 1):
        self.ngram = ngram
        self.tokens: List[int] = []
        self._followers: Dict[Tuple[int, ...], List[int]] = {}

    def extend(self, tokens: List[int]) -> None:
        for token in tokens:
            position = len(self.tokens)
            self.tokens.append(token)
            for n in range(1, min(self.ngram, position) + 1):
                self._followers.setdefault(tuple(self.tokens[position - n:position]), []).append(position)

    def follower(self, tail: Tuple[int, ...]) -> Optional[int]:
        """The token after the latest earlier occurrence of ``tail``, or None."""
        positions = self._followers.get(tail)
        return self.tokens[positions[-1]] if positions else None

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(n, len(self.tokens))
        for position in range(len(self.tokens) - 1, len(self.tokens) - n - 1, -1):  # the latest first
            for k in range(1, min(self.ngram, position) + 1):
                key = tuple(self.tokens[position - k:position])
                self._followers[key].pop()
                if not self._followers[key]:
                    del self._followers[key]
        del self.tokens[len(self.tokens) - n:]
        return n

    @property
    def offset(self) -> int:
        return len(self.tokens)

    @property
    def state(self) -> List[mx.array]:  # mlx-lm evaluates caches' state after each prefill chunk
        return []


class PromptLookup(nn.Module):
    """A draft "model" that looks its tokens up: called as mlx-lm calls a
    model, ``(tokens [1, L], cache) -> logits [1, L, V]``, it records the
    tokens and, at the last position, puts all weight on the token that
    followed the latest earlier occurrence of the last ``ngram`` tokens
    (longest match first, down to one token); with none, on the last token."""

    def __init__(self, ngram: int, vocab_size: int):
        super().__init__()
        self.ngram, self.vocab_size = ngram, vocab_size
        self.layers: List[Any] = []

    def make_cache(self) -> List[TokenHistory]:
        return [TokenHistory(self.ngram)]

    def predict(self, history: TokenHistory) -> int:
        """The drafted token after ``history``: what followed the latest earlier
        occurrence of its last ``ngram`` tokens, longest match first."""
        tokens = history.tokens
        for n in range(min(self.ngram, len(tokens) - 1), 0, -1):
            follower = history.follower(tuple(tokens[-n:]))
            if follower is not None:
                return follower
        return tokens[-1]

    def __call__(self, inputs: mx.array, cache: Optional[List[TokenHistory]] = None) -> mx.array:
        history = cache[0]
        history.extend(inputs.reshape(-1).tolist())
        logits = mx.full((1, inputs.shape[-1], self.vocab_size), -1e9, dtype=mx.float32)
        logits[0, -1, self.predict(history)] = 0.0
        return logits


def load_draft(path: str, vocab_size: int) -> nn.Module:
    """The draft model at ``path`` (folder or hub id), loaded whole by mlx-lm;
    refused in one line where its vocabulary differs from the model's."""
    from mlx_lm import load

    from mlxdist.ship.locate import resolve_model_path

    try:
        folder = resolve_model_path(path)
    except UserError as e:
        raise UserError(f"the draft model: {e}") from None
    model, _ = load(str(folder))
    rows = model.args.vocab_size if hasattr(getattr(model, "args", None), "vocab_size") else None
    if rows is not None and rows != vocab_size:
        raise UserError(f"the draft model {path} has a vocabulary of {rows} tokens, the model {vocab_size}: "
                        f"a draft must share the model's tokenizer")
    return model


def drafter(draft_model: Optional[nn.Module], prompt_lookup_ngram: int, vocab_size: int) -> Optional[nn.Module]:
    """What drafts a generation's tokens: the loaded draft model, else prompt
    lookup where asked, else None (plain decoding)."""
    if draft_model is not None:
        return draft_model
    if prompt_lookup_ngram:
        return PromptLookup(prompt_lookup_ngram, vocab_size)
    return None


def drafter_name(has_draft_model: bool, prompt_lookup_ngram: int) -> Optional[str]:
    """What ``drafter`` drafts with, in words (None: plain decoding); the
    verify widths are measured per drafter (``verify_width.py``)."""
    if has_draft_model:
        return "the draft model"
    if prompt_lookup_ngram:
        return f"prompt lookup ({prompt_lookup_ngram}-grams)"
    return None


@dataclass
class DraftTally:
    """What one generation drafted, kept and verified, counted from its
    stream of tokens: mlx-lm's loop drafts min(k, tokens still to make)
    tokens for each forward, yields the kept ones, then (unless the
    generation is full) the model's own token, which ends that forward; a
    forward that ends so with fewer drafts kept than made rejected one
    (``verify_width.py`` estimates the acceptance from that).
    With ``num_draft_tokens`` 0 (plain decoding) every token is a forward."""

    num_draft_tokens: int
    max_tokens: int
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    rejected: int = 0  # forwards that ended at a rejected draft
    forwards: int = 0
    _in_forward: bool = False  # the current forward's tokens are being yielded
    _forward_drafted: int = 0
    _forward_kept: int = 0

    def add(self, from_draft: bool) -> None:
        if not self._in_forward:
            self.forwards += 1
            self._forward_drafted = min(self.num_draft_tokens, self.max_tokens - self.tokens)
            self._forward_kept = 0
            self.drafted += self._forward_drafted
            self._in_forward = True
        self.tokens += 1
        if from_draft:
            self.accepted += 1
            self._forward_kept += 1
        else:
            self.rejected += self._forward_kept < self._forward_drafted
        self._in_forward = bool(from_draft)

    def stats(self) -> dict:
        """``draft_tokens`` drafted, ``draft_tokens_accepted`` kept, their
        ratio ``acceptance`` (None without drafts), ``tokens_per_forward``
        and ``num_draft_tokens``, the width drafted (0: plain decoding)."""
        return {"draft_tokens": self.drafted, "draft_tokens_accepted": self.accepted,
                "acceptance": self.accepted / self.drafted if self.drafted else None,
                "tokens_per_forward": self.tokens / max(self.forwards, 1),
                "num_draft_tokens": self.num_draft_tokens}
