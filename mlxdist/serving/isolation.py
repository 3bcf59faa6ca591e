"""A failed request fails that request only: the per-sequence code of
mlx-lm's generation loop, guarded.

mlx-lm's loop runs, for each sequence, code made from that request alone:
its tokenisation and stop matcher (``_tokenize``, ``_make_state_machine``),
its sampler and logits processors (``_make_sampler``,
``_make_logits_processors``, then called at every step) and its streaming
detokenizer. Each is guarded here: an exception marks the sequence failed
(its response queue gets a ``GenerationFailed``, an HTTP 500 for it alone),
the guard hands back a stand-in of the right shape (the logits unchanged,
the argmax token, no text), and the sequence's ``GenerationContext`` says
stop, so the loop removes it from the batch at that step exactly as it
removes a client that left: rank 0's removal is shared with the others.
Every rank runs the same per-sequence code on the same shared request and
tokens, so a deterministic failure happens on every rank at the same step.

mlx-lm makes a sequence's sampler, processors and detokenizer on the
generation thread right after it hands out the sequence's context, so the
guards find their sequence as the one that last received a context on this
thread (``Sequence.put``).

    Sequence(response_queue, max_tokens)   the queue the loop writes a request's output to
    guarded_factories(follow)              mlx-lm's sampler and processor factories, guarded
                                           (taking rank 0's tokens where every rank samples)
    guard_tokenizer(tokenizer) -> a copy   whose detokenizers are guarded
"""

import copy
import logging
import threading
from typing import Any, Callable, Dict, List, Optional

import mlx.core as mx
from mlx_lm.sample_utils import greedy_sampler

from mlxdist import compat
from mlxdist.compat import make_request_processors, make_request_sampler, set_detokenizer
from mlxdist.errors import GenerationFailed, one_line
from mlxdist.runtime import faults

_SETUP = threading.local()  # the sequence whose per-sequence code the generation thread is making


class Sequence:
    """One request's response queue in the generation loop, which can fail
    that request alone. ``tokens``: the tokens detokenized so far."""

    def __init__(self, queue, max_tokens: int):
        self.queue = queue
        self.max_tokens = max_tokens
        self.ctx: Optional[compat.GenerationContext] = None
        self.failed: Optional[BaseException] = None
        self.tokens = 0

    def put(self, item) -> None:
        if isinstance(item, compat.GenerationContext):
            self.ctx = item
            _SETUP.sequence = self
            if self.failed is not None:
                item.stop()
        if self.failed is None:  # after a failure the handler has its 500; the loop's later output is dropped
            self.queue.put(item)

    def fail(self, error: BaseException, where: str) -> None:
        """End this sequence with a 500; the loop removes it at this step."""
        if self.failed is None:
            self.failed = error
            logging.error("a sequence failed in its %s and ends alone: %s", where, one_line(error))
            self.queue.put(GenerationFailed(f"generation failed in this request's {where}: {one_line(error)}"))
        if self.ctx is not None:
            self.ctx.stop()

    def check(self, where: str) -> None:
        """The test-only per-sequence fault (``MLXDIST_FAULT=sequence:...``), if this is its moment."""
        if faults.FAULT is not None:
            faults.FAULT.maybe_fire_sequence(self.max_tokens, self.tokens, where)


def _setup_sequence() -> Optional[Sequence]:
    return getattr(_SETUP, "sequence", None)


def _guarded_sampler(make: Callable, follow: Callable[[], Any]) -> Callable:
    def make_sampler(args, tokenizer):
        root = follow()  # the mode in use: where every rank samples this row, rank 0's token
        sampler = _guarded(make, args, tokenizer)
        return sampler if root is None else root.sampler(sampler)

    return make_sampler


def _guarded(make: Callable, args, tokenizer) -> Callable:
    sequence = _setup_sequence()
    if sequence is None:
        return make(args, tokenizer)
    try:
        sampler = make(args, tokenizer)
    except Exception as e:  # noqa: BLE001 - this request fails, the batch goes on
        sequence.fail(e, "sampler")
        return greedy_sampler
    if sampler is greedy_sampler:
        return sampler  # mlx-lm's argmax, shared: the batch keeps its one batched call

    def sample(logprobs: mx.array) -> mx.array:  # [1, V] -> [1]
        if sequence.failed is None:
            try:
                sequence.check("sampler")
                return sampler(logprobs)
            except Exception as e:  # noqa: BLE001
                sequence.fail(e, "sampler")
        return mx.argmax(logprobs, axis=-1)

    return sample


def _guarded_processors(make: Callable) -> Callable:
    def make_logits_processors(args) -> List[Callable]:
        sequence = _setup_sequence()
        if sequence is None:
            return make(args)
        try:
            processors = make(args)
        except Exception as e:  # noqa: BLE001
            sequence.fail(e, "logits processors")
            return []
        return [_guarded_processor(p, sequence) for p in processors]

    return make_logits_processors


def _guarded_processor(processor: Callable, sequence: Sequence) -> Callable:
    def process(tokens: mx.array, logits: mx.array) -> mx.array:  # logits [1, V] -> [1, V]
        if sequence.failed is None:
            try:
                return processor(tokens, logits)
            except Exception as e:  # noqa: BLE001
                sequence.fail(e, "logits processors")
        return logits

    return process


def guarded_factories(follow: Callable[[], Any] = lambda: None) -> Dict[str, Callable]:
    """mlx-lm's per-sequence sampler and processor factories, guarded, under
    the names its generation loop looks them up by (``serving/server.py``
    gives the loop these, leaving mlx-lm's module as it is). ``follow()``,
    asked as each sampler is made: the engine's ``RootTokens`` where every
    rank samples that sequence (its samplers then take rank 0's tokens), else None."""
    return {"_make_sampler": _guarded_sampler(make_request_sampler, follow),
            "_make_logits_processors": _guarded_processors(make_request_processors)}


class _GuardedDetokenizer:
    """A streaming detokenizer that fails its sequence, not the loop. mlx-lm
    hands out a copy per sequence (``copy.copy``), so the copy takes the
    sequence being set up."""

    def __init__(self, inner, sequence: Optional[Sequence] = None):
        self._inner = inner
        self._sequence = sequence

    def __copy__(self):
        return _GuardedDetokenizer(copy.copy(self._inner), _setup_sequence())

    def _guard(self, where: Callable[[], Any], default: Any, check: bool = False) -> Any:
        sequence = self._sequence
        if sequence is None:
            return where()
        if sequence.failed is None:
            try:
                if check:
                    sequence.check("detokenizer")
                return where()
            except Exception as e:  # noqa: BLE001
                sequence.fail(e, "detokenizer")
        return default

    def reset(self) -> None:
        self._inner.reset()

    def add_token(self, token: int) -> None:
        self._guard(lambda: self._inner.add_token(token), None, check=True)
        if self._sequence is not None:
            self._sequence.tokens += 1

    def finalize(self) -> None:
        self._guard(self._inner.finalize, None)

    @property
    def last_segment(self) -> str:
        return self._guard(lambda: self._inner.last_segment, "")

    @property
    def text(self) -> str:
        return self._guard(lambda: self._inner.text, "")

    def __getattr__(self, name):  # tokens, offset
        if name.startswith("__") or name == "_inner":
            raise AttributeError(name)
        return getattr(self._inner, name)


def guard_tokenizer(tokenizer):
    """A copy of mlx-lm's ``TokenizerWrapper`` whose detokenizers fail their sequence alone."""
    guarded = copy.copy(tokenizer)
    set_detokenizer(guarded, _GuardedDetokenizer(tokenizer.detokenizer))
    return guarded
