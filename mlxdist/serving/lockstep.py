"""The server's generation loop on every rank, in lockstep: mlx-lm's
``ResponseGenerator`` with rank 0's requests and removals shared as JSON on
the control communicator (mlx-lm pickles), a stop every rank hears, progress
for the watchdog at every shared message and batch step. A failure in one
sequence's own code ends that sequence alone (``isolation.py``); a failure
of the batch step itself, on every rank, ends the requests in flight with a
500 and the loop goes on; on some ranks only, it ends the job
(``runtime/agreement.py``).
"""

import dataclasses
import json
import logging
import threading
import time
import typing
import weakref
from queue import Queue
from typing import Any, Optional

from mlxdist import compat
from mlxdist.errors import GenerationFailed, MlxdistError, RankLost, RequestError, one_line
from mlxdist.runtime.agreement import failed_together
from mlxdist.serving.isolation import Sequence
from mlxdist.serving.step_times import STEPS
from mlxdist.serving.token_channel import TokenRequest
from mlxdist.serving.token_channel import tokenized as token_request_tokens
from mlxdist.serving.tokenize import check_context, rendered_tokens, tokenizing_errors
from mlxdist.runtime.watchdog import ACTIVITY
from mlxdist.runtime.world import World


def _to_json(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_json(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [_to_json(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): _to_json(v) for k, v in obj.items()}
    return obj


def _from_json(cls: Any, data: Any) -> Any:
    """Rebuild a dataclass (and the dataclasses in its fields) from ``_to_json``'s form."""
    if dataclasses.is_dataclass(cls) and isinstance(data, dict):
        hints = typing.get_type_hints(cls)
        return cls(**{f.name: _from_json(hints[f.name], data[f.name]) for f in dataclasses.fields(cls)})
    args = [a for a in typing.get_args(cls) if a is not type(None)]
    if data is not None and len(args) == 1:  # Optional[X]
        return _from_json(args[0], data)
    if typing.get_origin(cls) is dict and data is not None and typing.get_args(cls)[0] is int:
        return {int(k): v for k, v in data.items()}  # logit_bias: JSON keys are strings
    return data


class TrackingQueue(Queue):
    """The generator's request queue, remembering each live request's
    response queue and the prompt text waiting in it (``chars``)."""

    def __init__(self):
        super().__init__()
        self.live = weakref.WeakSet()
        self.chars = 0

    def put(self, item, *args, **kwargs):
        self.live.add(item[0])
        super().put(item, *args, **kwargs)

    def _put(self, item):  # under the queue's lock
        self.chars += _request_chars(item[1])
        super()._put(item)

    def _get(self):
        item = super()._get()
        self.chars -= _request_chars(item[1])
        return item


def _request_chars(request) -> int:
    """The prompt text of an mlx-lm ``CompletionRequest``, in characters
    (a token request's as the front counted it)."""
    if isinstance(request, TokenRequest):
        return request.chars
    return len(request.prompt or "") + sum(len(str(m.get("content") or "")) for m in request.messages or [])


HANDLER_STATUS = threading.local()  # the status a refused request should get, per handler thread


class _SingleQueue:
    """The response queue of a request served alone (mlx-lm's
    ``_serve_single``, no batch, no shared message of its own): each response
    is progress for the watchdog and, on several ranks, a shared message, so
    rank 0's stop of the server or its client leaving ends the request on
    every rank at the same token (mlx-lm would stop it on rank 0 alone)."""

    def __init__(self, sequence: Sequence, generator: "LockstepResponseGenerator"):
        self.sequence = sequence
        self.generator = generator
        self.left = False  # rank 0: the client went away
        self.shared_end: Optional[GenerationFailed] = None  # an end every rank raised at the same token

    def put(self, item):
        ACTIVITY.progress()
        lockstep = self.generator.world.size > 1
        if lockstep and isinstance(item, Exception) and item is not self.shared_end:
            # mlx-lm's _serve_single ends the request with any exception and
            # goes on; on one rank alone the others are inside the step, so
            # the ranks agree first (or the job ends: runtime/agreement.py).
            agreed = failed_together(self.generator.world, item)
            if not isinstance(item, MlxdistError):
                item = GenerationFailed(f"generation failed: {agreed}")
        if lockstep and isinstance(item, compat.GenerationContext):
            item.stop = self._leave
        self.sequence.put(item)
        if lockstep and isinstance(item, compat.Response):
            left = self.generator._share_object(self.left)
            if self.generator._stop:
                self.shared_end = GenerationFailed("the server is shutting down")
            elif left:
                self.shared_end = GenerationFailed("the client left")  # on every rank: mlx-lm's loop ends the request
            if self.shared_end is not None:
                raise self.shared_end

    def _leave(self) -> None:
        self.left = True


class _ProgressBudget(compat.TimeBudget):
    """mlx-lm's time budget of batch steps between shared messages, telling
    the watchdog of each step taken (a step that never ends is a hung rank)
    and timing each (``step_times.STEPS``): mlx-lm calls it before every
    step of a run of steps and once after the last."""

    def __iter__(self):
        self._step_began = None
        return super().__iter__()

    def __next__(self):
        ACTIVITY.progress()
        now = time.perf_counter()
        if self._step_began is not None:
            STEPS.observe(now - self._step_began)
        self._step_began = now
        return super().__next__()


class LockstepResponseGenerator(compat.ResponseGenerator):
    """mlx-lm's response generator, sharing rank 0's requests and removals as
    JSON on mlxdist's control communicator, with a stop every rank hears."""

    def __init__(self, model_provider, prompt_cache, world: World):
        self.world = world
        self.rebalancer = None  # set by serve() where --rebalance-every asks for it (rebalance.py)
        self.single_prompt_cache = None  # set by serve() under dp: the prompt cache of a request served alone
        self._stop_requested = False
        self._failed = False
        self.failures = 0  # generation loops that failed and were entered again
        super().__init__(model_provider, prompt_cache)  # starts the generation thread
        self._time_budget = _ProgressBudget()
        self.requests = TrackingQueue()  # before any request: the thread reads it at its next poll

    def _share_object(self, obj):
        ACTIVITY.progress()  # the loop came round: this rank is not stuck
        if self.world.size == 1:
            return obj
        if self.world.is_root:
            rebalance = self.rebalancer is not None and self.rebalancer.due()
            message = {"stop": self._stop_requested, "obj": obj, "rebalance": rebalance}
            self.world.control.bcast_bytes(json.dumps(message).encode())
        else:
            message = json.loads(self.world.control.bcast_bytes(None))
        if message["stop"]:
            self._stop = True
            return None
        if message["rebalance"]:  # every rank, at this same message, between two steps
            self.rebalancer.run()
        return message["obj"]

    def _share_request(self, request):
        if self.world.size == 1:
            return None if request is None else (Sequence(request[0], request[2].max_tokens),) + tuple(request[1:])
        shared = None
        if request is not None:
            try:  # on rank 0 alone: a failure here must not leave the other ranks waiting
                shared = {"request": _to_json(request[1]), "args": _to_json(request[2])}
            except Exception as e:  # noqa: BLE001 - the request fails, the server goes on
                request[0].put(RequestError(f"cannot share this request with the other ranks: {one_line(e)}"))
        shared = self._share_object(shared)
        if shared is None:
            return None
        queue = request[0] if request is not None else Queue()
        args = _from_json(compat.GenerationArguments, shared["args"])
        kind = TokenRequest if shared["request"]["request_type"] == "tokens" else compat.CompletionRequest
        return Sequence(queue, args.max_tokens), _from_json(kind, shared["request"]), args

    def _tokenize(self, tokenizer, request, args):
        """mlx-lm's tokenisation, plus this request's stop matcher (so its
        failure too is this request's: the loop reports a failure here to the
        request alone), the context check, a chat request's prompt text
        when rank 0 rendered the request's own template (``templates.py``),
        and a token request's ids as the front tokenised them
        (``token_channel.py``)."""
        if args.top_logprobs > 0 and self.model_provider.engine.data_parallel is not None:
            raise RequestError("top_logprobs is not available with --mode dp (each rank gathers only the "
                               "sampled token's log-probability)")
        with tokenizing_errors():
            if isinstance(request, TokenRequest):
                tokenized = token_request_tokens(request)
            elif request.request_type == "chat" and request.prompt:
                tokenized = rendered_tokens(tokenizer, request.prompt)
            else:
                tokenized = super()._tokenize(tokenizer, request, args)
            self._make_state_machine(self.model_provider.model_key, tokenizer, args.stop_words)  # cached for the loop
        check_context(len(tokenized[0]), args.max_tokens, self.model_provider.engine.context_length)
        return tokenized

    def generate(self, request, generation_args, progress_callback=None):
        try:
            return super().generate(request, generation_args, progress_callback)
        except RequestError:
            HANDLER_STATUS.status = 400
            raise
        except GenerationFailed:
            HANDLER_STATUS.status = 500
            raise
        except RuntimeError:
            if not self.generation_available():
                HANDLER_STATUS.status = 503
            raise

    def _serve_single(self, request, stream):
        # One request alone (mlx-lm serves seeded ones so), its every token shared (``_SingleQueue``).
        request = (_SingleQueue(request[0], self),) + tuple(request[1:])
        engine = self.model_provider.engine
        engine.use(engine.mode_for(1))  # one sequence on every rank: the exact mode, also under dp
        self.model_provider.model = engine.model
        if self.single_prompt_cache is None:
            return super()._serve_single(request, stream)
        batched, self.prompt_cache = self.prompt_cache, self.single_prompt_cache  # this thread's alone
        try:
            return super()._serve_single(request, stream)
        finally:
            self.prompt_cache = batched

    def _run_generate(self):
        """mlx-lm's generation loop, entered again after a failure that is
        not one sequence's (those end their sequence alone, ``isolation.py``):
        the batch step itself (a prefill, a paging read), the loop's own
        code. mlx-lm's loop opens with a collective, so it is entered again
        only where every rank failed at that step (``runtime/agreement.py``):
        the requests in flight end with a 500 and the server goes on. A
        failure on some ranks only ends the job within seconds, with one
        line naming the rank and the cause (the others are inside the
        step's collectives)."""
        while not self._stop:
            try:
                self._generate()
            except Exception as e:  # noqa: BLE001 - reported to the requests it ends
                if self._stop:
                    break
                agreed = failed_together(self.world, e) if self.world.size > 1 else one_line(e)
                logging.error("generation failed, requests in flight end with 500: %s", agreed)
                for queue in list(self.requests.live):
                    queue.put(GenerationFailed(f"generation failed: {agreed}"))
                self.failures += 1
                time.sleep(0.1)  # a failure that repeats at once does not spin a core
            else:
                break

    def stop_and_join(self):
        """Stop serving on every rank: the next shared message says so."""
        if self.world.size == 1:
            self._stop = True
        self._stop_requested = True
        self._generation_thread.join()

    def fail(self) -> None:
        """A rank is gone: report unavailable, and end live requests with 503."""
        self._failed = True
        for queue in list(self.requests.live):
            queue.put(RankLost("the server lost a rank and is shutting down"))

    def generation_available(self):
        return not self._failed and super().generation_available()

