"""The server's generation loop on every rank, in lockstep: mlx-lm's
``ResponseGenerator`` with rank 0's requests and removals shared as JSON on
the control communicator (mlx-lm pickles), a stop every rank hears, progress
for the watchdog at every shared message and batch step, and a loop that a
failure does not end (the requests in flight get a 500).
"""

import dataclasses
import json
import logging
import threading
import time
import typing
import weakref
from typing import Any

from mlx_lm import server as lm_server

from mlxdist.errors import GenerationFailed, RankLost, RequestError, one_line
from mlxdist.runtime.watchdog import ACTIVITY
from mlxdist.runtime.world import World, bcast_bytes


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


class TrackingQueue(lm_server.Queue):
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
    """The prompt text of an mlx-lm ``CompletionRequest``, in characters."""
    return len(request.prompt or "") + sum(len(str(m.get("content") or "")) for m in request.messages or [])


HANDLER_STATUS = threading.local()  # the status a refused request should get, per handler thread


class _SingleQueue:
    """The response queue of a request served alone: each response is
    progress for the watchdog, and (``unstoppable``) its generation context
    ignores ``stop()``."""

    def __init__(self, queue, unstoppable: bool):
        self.queue = queue
        self.unstoppable = unstoppable

    def put(self, item):
        ACTIVITY.progress()
        if self.unstoppable and isinstance(item, lm_server.GenerationContext):
            item.stop = lambda: None
        self.queue.put(item)


class _ProgressBudget(lm_server.TimeBudget):
    """mlx-lm's time budget of batch steps between shared messages, telling
    the watchdog of each step taken (a step that never ends is a hung rank)."""

    def __next__(self):
        ACTIVITY.progress()
        return super().__next__()


class LockstepResponseGenerator(lm_server.ResponseGenerator):
    """mlx-lm's response generator, sharing rank 0's requests and removals as
    JSON on mlxdist's control communicator, with a stop every rank hears."""

    def __init__(self, model_provider, prompt_cache, world: World):
        self.world = world
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
            message = {"stop": self._stop_requested, "obj": obj}
            bcast_bytes(self.world, json.dumps(message).encode())
        else:
            message = json.loads(bcast_bytes(self.world, None))
        ACTIVITY.progress()  # every rank answered
        if message["stop"]:
            self._stop = True
            return None
        return message["obj"]

    def _share_request(self, request):
        if self.world.size == 1:
            return request
        shared = None
        if request is not None:
            try:  # on rank 0 alone: a failure here must not leave the other ranks waiting
                shared = {"request": _to_json(request[1]), "args": _to_json(request[2])}
            except Exception as e:  # noqa: BLE001 - the request fails, the server goes on
                request[0].put(RequestError(f"cannot share this request with the other ranks: {one_line(e)}"))
        shared = self._share_object(shared)
        if shared is None:
            return None
        queue = request[0] if request is not None else lm_server.Queue()
        return (queue, _from_json(lm_server.CompletionRequest, shared["request"]),
                _from_json(lm_server.GenerationArguments, shared["args"]))

    def _tokenize(self, tokenizer, request, args):
        if args.top_logprobs > 0 and self.model_provider.engine.data_parallel is not None:
            raise RequestError("top_logprobs is not available with --dispatch dp (each rank gathers only the "
                               "sampled token's log-probability)")
        tokenized = super()._tokenize(tokenizer, request, args)
        limit = self.model_provider.engine.context_length
        if limit is not None and len(tokenized[0]) + args.max_tokens > limit:
            raise RequestError(f"prompt of {len(tokenized[0])} tokens plus max_tokens {args.max_tokens} "
                               f"exceeds the model's context of {limit}")
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
        # One request alone (mlx-lm serves seeded ones so). mlx-lm cannot stop
        # it early on several ranks (it would stop on rank 0 only): a client
        # that leaves lets it run to its end instead.
        request = (_SingleQueue(request[0], unstoppable=self.world.size > 1),) + tuple(request[1:])
        engine = self.model_provider.engine
        engine.use(engine.strategy_for(1))  # one sequence on every rank: the exact strategy, also under dp
        self.model_provider.model = engine.model
        return super()._serve_single(request, stream)

    def _run_generate(self):
        """mlx-lm's generation loop, entered again after a failure: the
        requests in flight end with a 500 and the server goes on. A failure
        inside the lockstep loop comes from the shared requests, so every
        rank meets it at the same step and enters the loop again with the
        others (each rank's own failures, a lost rank, are the watchdog's)."""
        while not self._stop:
            try:
                self._generate()
            except Exception as e:  # noqa: BLE001 - reported to the requests it ends
                if self._stop:
                    break
                logging.error("generation failed, requests in flight end with 500: %s", one_line(e))
                for queue in list(self.requests.live):
                    queue.put(GenerationFailed(f"generation failed: {one_line(e)}"))
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
