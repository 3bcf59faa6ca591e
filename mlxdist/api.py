"""The Python API for scripted jobs.

    import mlxdist
    with mlxdist.init() as cluster:      # ranks other than 0 serve here, then exit
        cluster.load("path/or/hub-id", dispatch="collective")
        r = cluster.generate("Explain MoE routing.", max_tokens=64)
        print(r.text, r.tokens, r.stats)

Launched with ``mpirun -np N python script.py`` or as one plain process.
Every method runs on rank 0; errors in its arguments raise there and leave
the cluster usable.
"""

import random
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

from . import commands
from .commands import Command
from .dispatch import DISPATCHERS
from .engine import Engine, SamplingParams, UserError
from .mpi import World, init_world, run_or_abort
from .placement import Placement
from .server import LoadError, Server
from .watchdog import ACTIVITY, DEFAULT_TIMEOUT, start_watchdog

__all__ = ["Cluster", "LoadError", "Piece", "Result", "UserError", "init"]

Messages = List[Dict[str, str]]


@dataclass
class Result:
    """One finished generation."""

    text: str
    tokens: List[int]
    stats: Dict[str, Any] = field(default_factory=dict)


@dataclass
class Piece:
    """One step of a streamed generation: the new text and token."""

    text: str
    token: int
    finish_reason: Optional[str] = None
    logprobs: Any = None  # [vocab] log-probabilities of this step (an MLX array)


class Cluster:
    """Rank 0's handle on every rank of the job."""

    def __init__(self, world: World):
        self.world = world
        self.server = Server(world)
        self._closed = False

    # -- lifecycle -------------------------------------------------------
    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.shutdown(1 if exc_type is not None else 0)

    def shutdown(self, exit_code: int = 0) -> None:
        """Tell every other rank to exit (with ``exit_code``)."""
        if not self._closed:
            self._closed = True
            ACTIVITY.beat("exiting")
            self._broadcast(Command(commands.SHUTDOWN, {"exit_code": exit_code}))

    def _broadcast(self, command: Command) -> Command:
        return commands.broadcast(self.world, command)

    # -- commands --------------------------------------------------------
    def load(
        self,
        model: Optional[str] = None,
        dispatch: str = "collective",
        placement: Union[None, str, dict, Placement] = None,
        rank0_experts: bool = True,
    ) -> "Cluster":
        """Load ``model`` (a folder or hub id; None: the built-in random MoE)
        on every rank, releasing any model loaded before.

        ``placement``: a JSON file, a placement object or dict, or None for
        the even policy. Raises ``UserError``/``LoadError`` with one line."""
        if dispatch not in DISPATCHERS:
            raise UserError(f"unknown dispatch mode {dispatch!r} (choose {', '.join(DISPATCHERS)})")
        if isinstance(placement, str):
            placement = Placement.load(placement)
        if isinstance(placement, Placement):
            placement = placement.to_json()
        if model is None:
            from .synth import default_checkpoint

            model = str(default_checkpoint())
        args = {"model": str(model), "dispatch": dispatch, "placement": placement, "rank0_experts": rank0_experts}
        self.server.load(self._broadcast(Command(commands.LOAD, args)).args)
        return self

    @property
    def engine(self) -> Engine:
        if self.server.engine is None:
            raise UserError("no model is loaded: call load() first")
        return self.server.engine

    def encode(self, prompt: Optional[str] = None, messages: Optional[Messages] = None) -> List[int]:
        """Token ids of a prompt, or of chat ``messages`` through the
        tokenizer's chat template."""
        tokenizer = self.engine.tokenizer
        if (prompt is None) == (messages is None):
            raise UserError("give exactly one of prompt or messages")
        if messages is not None:
            if getattr(tokenizer, "chat_template", None) is None:
                raise UserError("this tokenizer has no chat template; pass prompt instead")
            return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        if not isinstance(prompt, str):
            raise UserError(f"prompt must be a string, got {type(prompt).__name__}")
        return list(tokenizer.encode(prompt))

    def _request(self, prompts: Sequence[List[int]], sampling: Dict[str, Any]) -> Command:
        params = SamplingParams(**sampling)
        if params.seed is None:
            params.seed = random.randrange(2**31)
        params.validate()
        limit = self.engine.context_length
        for ids in prompts:
            if not ids:
                raise UserError("the prompt is empty")
            if limit is not None and len(ids) + params.max_tokens > limit:
                raise UserError(
                    f"prompt of {len(ids)} tokens plus {params.max_tokens} new tokens "
                    f"exceeds the model's context of {limit}"
                )
        args = {"prompts": [list(map(int, p)) for p in prompts], "sampling": params.__dict__}
        return Command(commands.GENERATE, args)

    def stream_generate(
        self, prompt: Optional[str] = None, *, messages: Optional[Messages] = None, **sampling
    ) -> Iterator[Piece]:
        """Generate from one prompt, yielding each new piece of text.

        ``sampling``: max_tokens, temp, top_p, top_k, min_p, seed,
        prefill_step_size. Stopping early is safe: the remaining steps run
        (and are dropped) so every rank stays in step."""
        request = self._request([self.encode(prompt, messages)], sampling)
        yield from self._stream(request, {})

    def _stream(self, request: Command, stats: Dict[str, Any]) -> Iterator[Piece]:
        responses = self.server.generate(self._broadcast(request).args)
        try:
            for response in responses:
                stats.update(
                    prompt_tokens=response.prompt_tokens,
                    prompt_tps=response.prompt_tps,
                    generation_tokens=response.generation_tokens,
                    generation_tps=response.generation_tps,
                    finish_reason=response.finish_reason,
                )
                yield Piece(response.text, response.token, response.finish_reason, response.logprobs)
        finally:
            for _ in responses:  # the caller stopped early: finish in step
                pass
            stats["peak_memory_gb"] = [p / 1e9 for p in self.server.peaks()]
            stats["exchange"] = self.engine.dispatcher.stats.as_dict()

    def generate(
        self, prompt: Optional[str] = None, *, messages: Optional[Messages] = None, **sampling
    ) -> Result:
        """Generate from one prompt (or chat ``messages``); see ``stream_generate``."""
        request = self._request([self.encode(prompt, messages)], sampling)
        stats: Dict[str, Any] = {}
        pieces = list(self._stream(request, stats))
        text = "".join(p.text for p in pieces)
        return Result(text, [p.token for p in pieces], stats)

    def generate_batch(
        self,
        prompts: Sequence[Union[str, Messages]],
        **sampling,
    ) -> List[Result]:
        """Generate from several prompts at once, in one batch (left-padded,
        finished sequences leave it). Each prompt is a string or a list of
        chat messages. Greedy results equal each prompt's alone."""
        ids = [self.encode(messages=p) if isinstance(p, list) else self.encode(p) for p in prompts]
        if len(ids) == 1:
            return [self.generate(prompts[0] if isinstance(prompts[0], str) else None,
                                  messages=prompts[0] if isinstance(prompts[0], list) else None, **sampling)]
        request = self._request(ids, sampling)
        (response,) = list(self.server.generate(self._broadcast(request).args))
        peaks = self.server.peaks()
        s = response.stats
        stats = {
            "batch_prompt_tokens": s.prompt_tokens,
            "prompt_tps": s.prompt_tps,
            "generation_tokens": s.generation_tokens,
            "generation_tps": s.generation_tps,
            "batch_size": len(ids),
            "peak_memory_gb": [p / 1e9 for p in peaks],
        }
        return [
            Result(text, list(tokens), {**stats, "prompt_tokens": len(prompt)})
            for text, tokens, prompt in zip(response.texts, response.token_ids, ids)
        ]

    def stats(self, reset: bool = False) -> List[Dict[str, Any]]:
        """Per rank: slots computed, time in expert compute and waiting on the
        exchange (p2p), bytes moved, per-expert load counts, memory."""
        return self.server.stats(self._broadcast(Command(commands.STATS, {"reset": reset})).args)


def init(timeout: float = DEFAULT_TIMEOUT) -> Cluster:
    """Join the job. On rank 0, returns the ``Cluster`` handle; on every
    other rank, serves rank 0's commands and exits the process at shutdown.

    ``timeout``: seconds a generation may make no progress (a rank hung)
    before the job is ended with a report of who was waiting on whom."""
    world = init_world()
    start_watchdog(world, timeout)
    if world.is_root:
        return Cluster(world)
    code = run_or_abort(world, Server(world).serve)
    sys.stdout.flush()
    sys.exit(code)
