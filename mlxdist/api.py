"""The Python API for scripted jobs.

    import mlxdist
    with mlxdist.init() as cluster:      # ranks other than 0 serve here, then exit
        cluster.load("path/or/hub-id", mode="collective")
        r = cluster.generate("Explain MoE routing.", max_tokens=64)
        print(r.text, r.tokens, r.stats)

Launched with ``mpirun -np N python script.py`` or as one plain process.
Every method runs on rank 0; errors in its arguments raise there and leave
the cluster usable. A rank lost while a method runs (or before) raises
``RankLost`` within the heartbeat (``runtime/rank0_thread.py``); the job is
over then, and ends when the script does.
"""

import random
import sys
from dataclasses import dataclass, field, fields, replace
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

import mlx.core as mx

from mlxdist.runtime import control as commands
from mlxdist.runtime.control import Command
from mlxdist.dispatch import default_layout
from mlxdist.config import (
    AUTO_WIDTH, GenerateCommand, GenerationParams, LoadCommand, LoadOptions, PlaceCommand, ProbeCommand,
    ServeCommand, ShutdownCommand, StatsCommand,
)
from mlxdist.engine import Engine
from mlxdist.engine.speculative import DraftTally, drafter_name
from mlxdist.engine.verify_width import START, VerifyWidths
from mlxdist.errors import GenerationFailed, LoadError, RankLost, UserError, failure_line, say_error
from mlxdist.commands.executor import PROBES, CommandExecutor
from mlxdist.runtime.world import World, join
from mlxdist.runtime.exits import abort, run_or_abort, set_exit_code
from mlxdist.values.placement import Placement
from mlxdist.model.routing_file import RoutingStats
from mlxdist.dispatch.stats import add_shares
from mlxdist.engine.routing_record import RoutingRecorder
from mlxdist.runtime.gil import hold_no_lock_while_waiting
from mlxdist.runtime.heartbeat import FROM_ENVIRONMENT, ON_LOST, check_heartbeat, start_heartbeat
from mlxdist.runtime.rank0_thread import Rank0Thread
from mlxdist.runtime.watchdog import ACTIVITY, DEFAULT_TIMEOUT, start_watchdog

__all__ = ["Cluster", "LoadError", "Piece", "RankLost", "Result", "UserError", "init"]

Messages = List[Dict[str, str]]


@dataclass
class Result:
    """One finished generation."""

    text: str
    tokens: List[int]
    stats: Dict[str, Any] = field(default_factory=dict)
    logprobs: Optional[List[float]] = None  # batches: log-probability of each sampled token


@dataclass
class Piece:
    """One step of a streamed generation: the new text and token."""

    text: str
    token: int
    finish_reason: Optional[str] = None
    logprobs: Any = None  # [vocab] log-probabilities of this step (an MLX array)


class Cluster:
    """Rank 0's handle on every rank of the job."""

    def __init__(self, world: World, raise_rank_lost: bool = True):
        self.world = world
        self._own_thread = raise_rank_lost and world.size > 1  # else commands run in the caller's thread
        self.executor = CommandExecutor(world)
        self._closed = False
        self._recorder: Optional[RoutingRecorder] = None  # load(record_routing=...)
        self._open_stream: Optional[Iterator[Any]] = None  # the generation a stream reads, while it is open
        self._widths = VerifyWidths()  # speculative decoding's measured widths, this load's (num_draft_tokens="auto")
        self._rank0 = Rank0Thread()  # where every command runs while the caller waits (and hears of a loss)
        if self._own_thread:
            ON_LOST.append(self._rank0.lost)

    def _on_ranks(self, fn, *args):
        """``fn(*args)``: a command's rank-0 side, run on the rank-0 thread
        (``RankLost`` if a rank is lost meanwhile); in the caller's thread
        with one rank, or where a lost rank ends the process (``init(raise_rank_lost=False)``)."""
        return self._rank0.call(fn, *args) if self._own_thread else fn(*args)

    def _stop_hearing_losses(self) -> None:
        """From now on a lost rank ends the process (the heartbeat's own way)."""
        if self._rank0.lost in ON_LOST:
            ON_LOST.remove(self._rank0.lost)

    @property
    def lost(self) -> bool:
        """Whether a rank was lost: every command raises ``RankLost`` from then on."""
        return self._rank0.lost_line is not None

    # -- lifecycle -------------------------------------------------------
    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and issubclass(exc_type, SystemExit):  # sys.exit(n) in the block
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            set_exit_code(code)
            self.shutdown(code)
            return
        if exc_type is not None:
            set_exit_code(1)
        if self.lost:  # no rank can hear a shutdown; the exception says why
            set_exit_code(1)
            self._closed = True
            return
        if exc_type is not None and self.world.size > 1 and not issubclass(exc_type, (UserError, GenerationFailed)):
            # Not a refused request nor a generation every rank failed alike:
            # the other ranks may be inside a collective this rank left, and
            # would never hear a SHUTDOWN. End the job now.
            import traceback

            traceback.print_exception(exc_type, exc, tb)
            say_error(failure_line(self.world.rank, exc))
            abort(self.world, 1)
        self.shutdown(1 if exc_type is not None else 0)

    def shutdown(self, exit_code: int = 0) -> None:
        """Tell every other rank to exit (with ``exit_code``); after a lost
        rank, nothing (the ranks left end with this process)."""
        if self._closed:
            return
        self._stop_hearing_losses()
        if self.lost:
            self._closed = True
            set_exit_code(1)
            return
        if self._open_stream is not None:  # a stream left open ends at this token on every rank
            self._end_stream({})
        self._finish_recording()
        self._closed = True
        ACTIVITY.at("exiting")
        self._on_ranks(self._broadcast, ShutdownCommand(exit_code))

    def _broadcast(self, command: Command) -> Command:
        if self._open_stream is not None:
            # The other ranks are between two tokens of the stream, waiting to
            # hear whether its reader wants more: a command now would meet that.
            raise UserError(f"a stream is open: read it to its end or close() it before {command.op}")
        return commands.broadcast(self.world, command)

    # -- commands --------------------------------------------------------
    def load(
        self,
        model: Optional[str] = None,
        options: Optional[LoadOptions] = None,
        *,
        record_routing: Optional[str] = None,
        record_routing_every: Optional[float] = None,
        count_routing: bool = False,
        **overrides: Any,
    ) -> "Cluster":
        """Load ``model`` (a folder or hub id; None: ``options.model``, else
        the built-in random MoE) on every rank, releasing any model loaded
        before.

        ``options``: a ``config.LoadOptions`` (None: its defaults, the layout
        as rank 0's device suggests). ``overrides``: any of its fields by
        name, over ``options``; ``layout=None`` takes the device's default.
        The fields:

        ``dispatch``: auto (the default), collective, p2p, collective-tp or dp. ``placement``: a JSON
        file, a placement object or dict, or None for the even policy.
        ``rank0_experts``: False keeps rank 0's experts on the other ranks.
        ``layout``: the collective modes' masked or compact slots (None:
        compact on the CPU, masked on GPUs, as rank 0 sees its device).
        ``stats``: count routed slots per expert (a cost on every MoE layer).
        ``expert_capacity``: experts each rank keeps resident per layer, the
        rest paged in from its checkpoint copy (compact layout or p2p);
        ``memory_budget_gb``: instead, the weight bytes each rank may hold,
        which set its capacity. ``expert_split``: "whole" (each expert on
        one rank), "width" (every expert cut over the ranks, as tensor
        parallelism cuts them: balanced, not bit-exact; every mode but p2p)
        or "auto" (under ``mode="auto"``, the cut weighed cheaper at
        load where nothing needs whole experts, else whole; the cut taken is
        ``engine.options.expert_split``, why ``engine.split``).
        ``record_routing``: a file rank 0 writes the routed slots per expert
        to (``routing()``; at ``shutdown`` or the next ``load``, and every
        ``record_routing_every`` seconds while it runs, where rank 0 sees
        every slot). ``rank_memory_gb``: GB of expert weights each rank may
        keep resident, one per rank, or a dict by host name (a host's GB
        shared by its ranks): the even placement follows them, and a
        placement that does not fit is refused (docs/placement.md).
        ``count_routing``: count routed slots per expert without a file (what
        the server's rebalancing reads). ``draft_model``: a small model with
        the same tokenizer for speculative decoding of single prompts
        (``num_draft_tokens`` per request; docs/modes.md). ``revision``: a
        hub id's branch, tag or commit (None: main). ``replicate`` (dispatch
        auto): "always" puts every expert on every rank, so that batches of a
        sequence per rank or more run as N replicas with no exchange; "auto"
        does that where every host has room for the whole model per rank and
        nothing else says where experts go; "never" spreads them.
        ``exact``: every batch bit-exact (auto runs collective with whole
        experts; dp and collective-tp are refused). ``remeasure`` (auto):
        measure and decide again rather than reuse the decision stored at an
        earlier load of this model on these hosts (``engine.decision``).
        ``kv_reserve_tokens``: KV-cache tokens each rank that runs attention
        keeps room for, at the model's own cache size per token (docs/memory.md).
        Raises ``UserError``/``LoadError`` with one line, and ``TypeError``
        for a keyword that is no field."""
        options = _load_options(model, options, overrides)
        options.record_routing = options.record_routing or record_routing is not None or count_routing
        options.validate()
        self._finish_recording()
        self._on_ranks(lambda: self.executor.load(self._broadcast(LoadCommand(options))))
        self._widths = VerifyWidths()  # what the last load's generations measured is not this one's
        if record_routing is not None:
            self._recorder = RoutingRecorder(self.engine, record_routing, record_routing_every)
        return self

    def routing(self) -> RoutingStats:
        """The routed slots per (layer, expert) of every rank since the
        load (needs ``load(record_routing=...)``), gathered on rank 0."""
        if self._recorder is None:
            raise UserError("routing is recorded only after load(record_routing=FILE)")
        reports = self._on_ranks(lambda: self.executor.stats(self._broadcast(StatsCommand(routing=True))))
        return self._recorder.record(add_shares(r.get("routing", {}) for r in reports))

    def _finish_recording(self) -> None:
        """Write the routing file of the model loaded (if recorded), and stop recording."""
        recorder, self._recorder = self._recorder, None
        if recorder is None or self.executor.engine is None or self.world.lost or self.lost:
            return
        self._recorder = recorder
        try:
            stats = self.routing()
            try:
                stats.save(recorder.path)
            except OSError as e:
                say_error(f"cannot write the routing file {recorder.path}: {e.strerror}")
        finally:
            recorder.close()
            self._recorder = None

    @property
    def engine(self) -> Engine:
        """Rank 0's loaded engine (model, tokenizer, placement, dispatcher)."""
        if self.executor.engine is None:
            raise UserError("no model is loaded: call load() first")
        return self.executor.engine

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

    def request(self, prompts: Sequence[List[int]], mode: Optional[str] = None, **sampling) -> GenerateCommand:
        """A checked GENERATE command for these token-id prompts (not sent
        yet: ``stream`` or ``run_batch`` runs it). ``sampling``: the fields of
        ``GenerationParams``. ``mode``: run a batch with this one of the
        loaded modes instead of auto's choice (e.g. "collective", the
        exact one). Raises ``UserError`` for bad parameters, an empty prompt
        or one past the model's context."""
        if "strategy" in sampling:  # mode's old name, kept for one release
            if mode is not None:
                raise UserError("request() takes mode= (strategy= is its old name): give one of them")
            mode = sampling.pop("strategy")
        if mode is not None and mode not in self.engine.dispatchers:
            raise UserError(f"mode {mode!r} is not loaded (loaded: {', '.join(self.engine.dispatchers)})")
        try:
            params = GenerationParams(**sampling)
        except TypeError as e:
            raise UserError(str(e).replace("__init__() ", "")) from None
        if params.seed is None:
            params.seed = random.randrange(2**31)
        params.validate()
        if isinstance(params.max_tokens, list) and len(params.max_tokens) != len(prompts):
            raise UserError(f"max_tokens lists {len(params.max_tokens)} values for {len(prompts)} prompts")
        limit = self.engine.context_length
        for ids, max_tokens in zip(prompts, params.max_tokens_each(len(prompts))):
            if not ids:
                raise UserError("the prompt is empty")
            if limit is not None and len(ids) + max_tokens > limit:
                raise UserError(
                    f"prompt of {len(ids)} tokens plus {max_tokens} new tokens "
                    f"exceeds the model's context of {limit}"
                )
        verify_width = None
        if params.num_draft_tokens == AUTO_WIDTH:  # every rank is sent the number
            drafter = self._drafter(params) if len(prompts) == 1 else None
            params.num_draft_tokens, verify_width = self._widths.choose(drafter) if drafter else (START, None)
        return GenerateCommand([list(map(int, p)) for p in prompts], params, mode, verify_width=verify_width)

    def _drafter(self, params: GenerationParams) -> Optional[str]:
        """Which drafter a one-prompt generation with ``params`` runs (None: plain decoding)."""
        return drafter_name(self.engine.draft_model is not None, params.prompt_lookup_ngram)

    def stream_generate(
        self, prompt: Optional[str] = None, *, messages: Optional[Messages] = None, **sampling
    ) -> Iterator[Piece]:
        """Generate from one prompt, yielding each new piece of text.

        ``sampling``: max_tokens, temp, top_p, top_k, min_p, seed,
        prefill_step_size, max_kv_size, num_draft_tokens,
        prompt_lookup_ngram (speculative decoding). Stopping early is safe: the
        remaining steps run (and are dropped) so every rank stays in step.
        While it is open, any other command raises ``UserError`` (read the
        stream to its end, or ``close()`` it, first)."""
        request = self.request([self.encode(prompt, messages)], **sampling)
        yield from self.stream(request)

    def stream(self, request: GenerateCommand, stats: Optional[Dict[str, Any]] = None) -> Iterator[Piece]:
        """Run a one-prompt ``request`` on every rank, yielding each piece.
        ``stats`` (a dict) receives mlx-lm's counters, speculative
        decoding's (``draft_tokens``, ``draft_tokens_accepted``,
        ``acceptance``, ``tokens_per_forward``, ``num_draft_tokens``; and
        ``verify_width``, a line saying how ``num_draft_tokens="auto"``
        chose it), the peak memory of every rank and the exchange counters
        once the stream ends."""
        stats = {} if stats is None else stats
        request = self._on_ranks(self._broadcast, request)
        responses = self.executor.generate(request)  # a generator: its steps run on the rank-0 thread
        self._open_stream = responses
        sampling = request.sampling
        drafter = self._drafter(sampling)  # None: plain decoding
        tally = DraftTally(sampling.num_draft_tokens if drafter else 0, sampling.max_tokens_each(1)[0])
        if request.verify_width:
            stats["verify_width"] = request.verify_width
        try:
            while True:
                response = self._on_ranks(_next_evaluated, responses)
                if response is None:
                    break
                tally.add(response.from_draft)
                stats.update(
                    prompt_tokens=response.prompt_tokens,
                    prompt_tps=response.prompt_tps,
                    generation_tokens=response.generation_tokens,
                    generation_tps=response.generation_tps,
                    finish_reason=response.finish_reason,
                    **tally.stats(),
                )
                yield Piece(response.text, response.token, response.finish_reason, response.logprobs)
        finally:
            if self._open_stream is responses:  # not ended already by shutdown()
                self._end_stream(stats)
        if drafter is not None:
            self._record_width(drafter, tally, stats)

    def _record_width(self, drafter: str, tally: DraftTally, stats: Dict[str, Any]) -> None:
        """What a generation ``drafter`` drafted measured, for the widths
        ``auto`` chooses next: its drafts kept and rejected, and its decoding
        time after the first token over the forwards after the first."""
        if not stats.get("finish_reason"):  # cut short
            return
        seconds = stats["generation_tokens"] / stats["generation_tps"] if stats.get("generation_tps") else 0.0
        self._widths.record(drafter, tally.num_draft_tokens, tally.accepted, tally.rejected, seconds,
                            tally.forwards - 1)

    def _end_stream(self, stats: Dict[str, Any]) -> None:
        """End the open stream on every rank (at this token, where its reader stopped early)."""
        responses, self._open_stream = self._open_stream, None
        if self.lost:
            return

        def end():
            responses.close()
            after = self.executor.after_generation()
            return [a["peak"] / 1e9 for a in after], self.engine.dispatcher.stats.as_dict()

        stats["peak_memory_gb"], stats["exchange"] = self._on_ranks(end)

    def generate(
        self, prompt: Optional[str] = None, *, messages: Optional[Messages] = None, **sampling
    ) -> Result:
        """Generate from one prompt (or chat ``messages``); see ``stream_generate``."""
        request = self.request([self.encode(prompt, messages)], **sampling)
        stats: Dict[str, Any] = {}
        pieces = list(self.stream(request, stats))
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
        return self.run_batch(self.request(ids, **sampling))

    def run_batch(self, request: GenerateCommand) -> List[Result]:
        """Run a request of several prompts as one batch on every rank."""
        ids = request.prompts
        response, after = self._on_ranks(self._run_batch, replace(request, batch=True))
        s = response.stats
        stats = {
            "batch_prompt_tokens": s.prompt_tokens,
            "prompt_tps": s.prompt_tps,
            "generation_tokens": s.generation_tokens,
            "generation_tps": s.generation_tps,
            "batch_size": len(ids),
            "mode_in_use": self.engine.mode_in_use,
            "strategy": self.engine.mode_in_use,  # the old name of "mode_in_use", kept for one release
            "peak_memory_gb": [a["peak"] / 1e9 for a in after],
            "kv_cache_gb": [a["kv"] / 1e9 if a["kv"] is not None else None for a in after],
        }
        logprobs = response.logprobs or [None] * len(ids)
        return [
            Result(text, list(tokens), {**stats, "prompt_tokens": len(prompt)}, lp)
            for text, tokens, prompt, lp in zip(response.texts, response.token_ids, ids, logprobs)
        ]

    def _run_batch(self, request: GenerateCommand):
        """``run_batch``'s rank-0 side: the response and every rank's memory after it."""
        command = self._broadcast(request)
        try:
            (response,) = list(self.executor.generate(command))
        finally:  # also after a generation every rank failed alike (the job goes on)
            after = self.executor.after_generation()
        mx.eval(response.logprobs or [])  # arrays of the rank-0 thread's streams, read by the caller
        return response, after

    def stats(self, reset: bool = False, collect: Optional[bool] = None) -> List[Dict[str, Any]]:
        """Per rank: slots computed, time in expert compute and waiting on the
        exchange (p2p), bytes moved, memory, and per-expert load counts
        (counted only while switched on: ``load(stats=True)`` or
        ``collect=True`` here; ``collect=False`` stops counting)."""
        command = StatsCommand(reset=bool(reset), collect=None if collect is None else bool(collect))
        return self._on_ranks(lambda: self.executor.stats(self._broadcast(command)))

    def place(self, placement: Union[str, dict, Placement]) -> List[float]:
        """Hold ``placement``'s experts from now on (a JSON file, a placement
        object or dict), on every rank at once, between generations: each
        rank reads the experts it newly holds from its checkpoint copy and
        keeps the others; results do not change. Returns each rank's
        seconds. Raises ``UserError`` with one line, the old placement kept."""
        placement = _placement_json(placement)
        Placement.from_json(placement)  # refused here, before any rank hears of it
        return self._on_ranks(lambda: self.executor.place(self._broadcast(PlaceCommand(placement))))

    def serve_http(self, options: Dict[str, Any]) -> None:
        """Serve the loaded model over HTTP on rank 0, every rank batching in
        lockstep, until interrupted (``python -m mlxdist.serve``). A lost rank
        ends the process here (the server answers what it holds first), as
        its own thread runs the batches."""
        self._stop_hearing_losses()
        self.executor.serve_http(self._on_ranks(self._broadcast, ServeCommand(options)))

    def probe(self, name: str, **args) -> List[Any]:
        """Run the probe registered as ``name`` (``executor.register_probe``)
        on every rank at once; returns each rank's answer."""
        if name not in PROBES:
            raise UserError(f"no probe named {name!r} is registered")
        return self._on_ranks(lambda: self.executor.probe(self._broadcast(ProbeCommand(name, args))))


def _next_evaluated(responses: Iterator[Any]) -> Any:
    """The next response of a stream (None at its end), its log-probabilities
    evaluated: MLX streams belong to a thread, and the caller reads them on its own."""
    response = next(responses, None)
    if response is not None and response.logprobs is not None:
        mx.eval(response.logprobs)
    return response


def _load_options(model: Optional[str], options: Optional[LoadOptions], overrides: Dict[str, Any]) -> LoadOptions:
    """``load``'s options as LOAD carries them: ``options`` (or the defaults)
    with ``overrides`` and ``model`` over them, the placement as its JSON
    object and the budgets as numbers."""
    if options is not None and not isinstance(options, LoadOptions):
        raise UserError(f"options must be a LoadOptions, not {type(options).__name__}")
    if "dispatch" in overrides:  # mode's old name, kept for one release
        if "mode" in overrides:
            raise UserError("load() takes mode= (dispatch= is its old name): give one of them")
        overrides["mode"] = overrides.pop("dispatch")
    names = {f.name for f in fields(LoadOptions)} - {"model", "record_routing"}
    for name in overrides:
        if name not in names:
            raise TypeError(f"load() got an unexpected keyword argument {name!r}")
    if overrides.get("layout", "") is None or (options is None and "layout" not in overrides):
        overrides["layout"] = default_layout()
    if model is None and options is None:
        from mlxdist.synth import default_checkpoint

        model = default_checkpoint()
    if model is not None:
        overrides["model"] = str(model)
    options = replace(options, **overrides) if options is not None else LoadOptions(**overrides)
    return replace(options, placement=_placement_json(options.placement),
                   rank_memory_gb=_budgets(options.rank_memory_gb))


def _placement_json(placement: Union[None, str, dict, Placement]) -> Optional[dict]:
    """A placement as LOAD and PLACE carry it: a file read, an object as its JSON object."""
    if isinstance(placement, str):
        placement = Placement.load(placement)
    return placement.to_json() if isinstance(placement, Placement) else placement


def _budgets(rank_memory_gb) -> Union[None, List[float], Dict[str, float]]:
    """``load``'s budgets as LOAD carries them: GB by host name, or by rank."""
    if rank_memory_gb is None:
        return None
    if isinstance(rank_memory_gb, dict):
        return {str(k): _gb(v) for k, v in rank_memory_gb.items()}
    return [_gb(b) for b in rank_memory_gb]


def _gb(value):
    """A budget as LOAD carries it: a number as a float; anything else as
    given, for ``LoadOptions.validate`` to refuse (float() would read "５",
    "nan" and True)."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def init(timeout: float = DEFAULT_TIMEOUT, backend: Optional[str] = None,
         heartbeat: Union[None, float, str] = FROM_ENVIRONMENT, raise_rank_lost: bool = True) -> Cluster:
    """Join the job. On rank 0, returns the ``Cluster`` handle; on every
    other rank, serves rank 0's commands and exits the process at shutdown.

    The one start-up path: the command line, the server, the benchmark and
    scripts all begin here (``mlxdist.run`` joins the job first, with
    ``world.join``, to check its input before this module's imports). A job
    that cannot start (no MPI library, a peer lost while starting, a
    launcher mlxdist cannot run under) ends with status 1 and one line (from
    rank 0 alone where every rank has the same problem).

    ``timeout``: seconds a generation may make no progress (a rank hung)
    before the job is ended with a report of who was waiting on whom.
    ``backend``: MLX's transport for arrays, "mpi", "nccl", "ring", "jaccl" or "jaccl-ring" (default: nccl
    where MLX runs on CUDA, else mpi).
    ``heartbeat``: seconds a rank may send no heartbeat before it is lost and
    the job ends with one line naming it (``runtime/heartbeat.py``); None,
    0 or "off": no heartbeat; "default": ``MLXDIST_HEARTBEAT``, else 5 s.
    Anything else raises ``UserError``.
    ``raise_rank_lost``: a rank lost then raises ``RankLost`` in the caller
    (its commands run on a thread of their own on rank 0,
    ``runtime/rank0_thread.py``); False: they run in the caller's thread and
    the loss ends the process with the heartbeat's line (the command line's way)."""
    seconds = check_heartbeat(heartbeat)
    world = join(backend)
    hold_no_lock_while_waiting()  # else a lost rank can leave the threads below without the GIL
    start_watchdog(world, timeout)
    start_heartbeat(world, seconds)
    if world.is_root:
        return Cluster(world, raise_rank_lost)
    code = run_or_abort(world, CommandExecutor(world).serve)
    set_exit_code(code)
    sys.stdout.flush()
    sys.exit(code)
