"""What a user chooses: the load options LOAD carries and the generation
parameters GENERATE carries, each checked on rank 0 before any rank acts;
and the typed commands that carry them (and the others) to every rank.
The dispatch modes themselves are in ``dispatch/modes.py``, ``auto``'s rule in ``decide/rule.py``.
"""

import argparse
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

from mlxdist.inputs.digits import arg_int
from mlxdist.dispatch import LAYOUTS, modes
from mlxdist.errors import UserError
from mlxdist.runtime import control
from mlxdist.runtime.control import Command

# mlx_lm.generate's DEFAULT_MAX_TOKENS, written here so that the command lines
# parse (and refuse a bad flag) before mlx-lm is imported; tests/test_compat.py
# checks that the two agree.
DEFAULT_MAX_TOKENS = 100

__all__ = ["AUTO_SPLIT", "EXPERT_SPLITS", "REPLICATE", "GenerateCommand", "GenerationParams", "LoadCommand",
           "LoadOptions", "PlaceCommand", "ProbeCommand", "ServeCommand", "ShutdownCommand", "StatsCommand"]

AUTO_SPLIT = "auto"  # --expert-split chosen at load (LoadOptions.expert_split)
EXPERT_SPLITS = (AUTO_SPLIT, "whole", "width")
REPLICATE = ("auto", "always", "never")  # --replicate: every expert on every rank (LoadOptions.replicate)
MAX_DRAFT_TOKENS = 64  # drafted tokens one verifying forward may carry
AUTO_WIDTH = "auto"  # num_draft_tokens chosen per generation (engine/verify_width.py)
MAX_LOOKUP_NGRAM = 64
KV_RESERVE_TOKENS = 32768  # --kv-reserve-tokens by default (model/fit.py): e.g. 8 sequences of 4,096
MAX_KV_RESERVE_TOKENS = 1 << 30


def kv_reserve_tokens_arg(text: str) -> int:
    """An argparse type for ``--kv-reserve-tokens``: an integer from 1 to ``MAX_KV_RESERVE_TOKENS``."""
    value = arg_int(1)(text)
    if value > MAX_KV_RESERVE_TOKENS:
        raise argparse.ArgumentTypeError(f"the value must be at most {MAX_KV_RESERVE_TOKENS}, not {value}")
    return value


@dataclass
class LoadOptions:
    """What LOAD carries: chosen on rank 0, broadcast, fingerprinted."""

    model: str
    mode: str = "auto"  # --mode (the old --dispatch and load(dispatch=) kept for one release)
    layout: str = "masked"  # collective modes: "masked" or "compact" (see dispatch/collective.py)
    placement: Optional[dict] = None  # a placement's JSON object; None: the even policy
    rank0_experts: bool = True
    stats: bool = False  # count routed slots per expert from the start
    expert_capacity: Optional[int] = None  # experts resident per layer and rank; the rest paged in (paging.py)
    memory_budget_gb: Optional[float] = None  # weight bytes a rank may hold: sets its expert capacity (paging.py)
    # "whole": each expert on one rank; "width": every expert cut over the ranks; "auto": under
    # --mode auto, the one decide/splitcost.py weighs cheaper at load where nothing needs whole
    # experts (else whole); the engine's options hold the cut taken
    expert_split: str = AUTO_SPLIT
    record_routing: bool = False  # count routed slots per expert for the routing file (--record-routing)
    # GB of expert weights each rank may keep resident (--rank-memory): by rank, or by host name
    rank_memory_gb: Optional[Union[List[float], Dict[str, float]]] = None
    revision: Optional[str] = None  # a hub id's branch, tag or commit (--revision); None: main
    draft_model: Optional[str] = None  # speculative decoding's draft model, loaded whole where the dense model runs
    # auto: every rank holds every expert (batches as N replicas) where every host has room for a
    # whole model per rank; always / never: whatever the memory says (--replicate, mode auto only)
    replicate: str = "auto"
    # KV-cache tokens reserved on every rank that runs attention, at the model's own cache's size per
    # token (--kv-reserve-tokens; model/fit.py)
    kv_reserve_tokens: int = KV_RESERVE_TOKENS
    # every batch bit-exact: auto runs collective with whole experts (the exact modes stay as they are)
    exact: bool = False
    remeasure: bool = False  # auto: measure and decide again, not the decision stored at an earlier load

    def validate(self) -> None:
        modes.mode(self.mode)
        if not isinstance(self.exact, bool) or not isinstance(self.remeasure, bool):
            raise UserError("exact and remeasure take true or false")
        if self.exact:
            modes.check_exact(self.mode, self.expert_split, self.replicate)
        if self.revision is not None and not (isinstance(self.revision, str) and 0 < len(self.revision) <= 256
                                              and self.revision.isprintable()):
            raise UserError(f"--revision must be a branch, tag or commit, not {self.revision!r:.60}")
        if self.layout not in LAYOUTS:
            raise UserError(f"unknown layout {self.layout!r} (choose {', '.join(LAYOUTS)})")
        if self.expert_capacity is not None and self.memory_budget_gb is not None:
            raise UserError("give --expert-capacity or --memory-budget, not both")
        if self.memory_budget_gb is not None and not 0 < self.memory_budget_gb < float("inf"):
            raise UserError(f"--memory-budget must be a positive, finite number of GB, not {self.memory_budget_gb}")
        if self.expert_split not in EXPERT_SPLITS:
            raise UserError(f"unknown expert split {self.expert_split!r} (choose {', '.join(EXPERT_SPLITS)})")
        if self.expert_capacity is not None or self.memory_budget_gb is not None:
            if self.expert_capacity is not None and self.expert_capacity < 1:
                raise UserError(f"--expert-capacity must be at least 1, not {self.expert_capacity}")
        budgets = self.rank_memory_gb
        if isinstance(budgets, dict) and all(isinstance(h, str) and h for h in budgets):
            budgets = list(budgets.values())  # per host name (model/budgets.py matches them to ranks)
        if budgets is not None and not (
                isinstance(budgets, list) and budgets
                and all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 < b < float("inf")
                        for b in budgets)):
            raise UserError(f"--rank-memory must give a positive number of GB per rank or per host, not "
                            f"{self.rank_memory_gb!r:.60}")
        if not (isinstance(self.kv_reserve_tokens, int) and not isinstance(self.kv_reserve_tokens, bool)
                and 1 <= self.kv_reserve_tokens <= MAX_KV_RESERVE_TOKENS):
            raise UserError(f"--kv-reserve-tokens takes a number of tokens from 1 to {MAX_KV_RESERVE_TOKENS}, not "
                            f"{self.kv_reserve_tokens!r:.40}")
        if self.draft_model is not None and not (isinstance(self.draft_model, str) and self.draft_model.strip()):
            raise UserError(f"--draft-model takes a folder or hub id, not {self.draft_model!r:.60}")
        if self.replicate not in REPLICATE:
            raise UserError(f"--replicate takes {', '.join(REPLICATE)}, not {self.replicate!r:.40}")
        if self.replicate == "always" and not self.may_replicate:
            able = " or ".join(n for n, m in modes.MODES.items() if m.replicates)
            raise UserError(f"--replicate always puts every expert on every rank under --mode {able}: it takes no "
                            "other --mode, placement, --no-rank0-experts, --rank-memory, --expert-capacity, "
                            "--memory-budget or --expert-split width")
        if self.expert_split == "width" and (self.record_routing or self.rank_memory_gb is not None):
            raise UserError("--expert-split width cuts every expert over every rank: it takes no --record-routing "
                            "or --rank-memory (both are about whole experts)")
        modes.check_options(self.mode, self.layout, self.expert_split, self.pages, self.placed)

    @property
    def pages(self) -> bool:
        """Experts paged in from disk (--expert-capacity or --memory-budget)."""
        return self.expert_capacity is not None or self.memory_budget_gb is not None

    @property
    def may_replicate(self) -> bool:
        """Whether every expert may go on every rank (--replicate): a mode that
        replicates, and nothing else saying where the experts go."""
        return (modes.mode(self.mode).replicates and not self.placed and not self.pages
                and self.expert_split != "width" and not self.exact)

    @property
    def may_cut_in_width(self) -> bool:
        """Whether ``--expert-split auto`` may cut the experts in width: under
        ``--mode auto``, with nothing that needs whole experts (a
        placement, budgets, paging, --record-routing, --replicate always)."""
        return (self.expert_split == AUTO_SPLIT and modes.mode(self.mode).cuts_experts and not self.placed
                and not self.pages and not self.record_routing and self.replicate != "always" and not self.exact)

    @property
    def placed(self) -> bool:
        """Where the experts go is given (a placement, --no-rank0-experts or --rank-memory)."""
        return self.placement is not None or not self.rank0_experts or self.rank_memory_gb is not None


@dataclass
class GenerationParams:
    """What GENERATE carries besides the prompts; validated on rank 0.
    ``max_tokens`` may be a list: one per prompt of a batch."""

    max_tokens: Union[int, List[int]] = DEFAULT_MAX_TOKENS
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    prefill_step_size: int = 2048
    max_kv_size: Optional[int] = None  # a rotating KV cache of this many tokens
    completion_batch_size: Optional[int] = None  # most sequences decoded at once (None: all)
    # speculative decoding (one prompt): tokens drafted per verifying forward, or "auto": rank 0
    # chooses it per generation (engine/verify_width.py) and sends every rank the number
    num_draft_tokens: Union[int, str] = AUTO_WIDTH
    prompt_lookup_ngram: int = 0  # draft by prompt lookup on the last this-many tokens (0: off)

    def validate(self) -> None:
        for max_tokens in self.max_tokens if isinstance(self.max_tokens, list) else [self.max_tokens]:
            if not (isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens >= 1):
                raise UserError(f"max_tokens must be at least 1, got {max_tokens}")
        if not self.temp >= 0:
            raise UserError(f"temperature must be >= 0, got {self.temp}")
        if self.temp == float("inf"):
            raise UserError(f"temperature must be finite, got {self.temp}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}")
        if not self.top_k >= 0:
            raise UserError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise UserError(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.prefill_step_size >= 1:
            raise UserError(f"prefill_step_size must be >= 1, got {self.prefill_step_size}")
        if self.max_kv_size is not None and not self.max_kv_size >= 1:
            raise UserError(f"max_kv_size must be >= 1, got {self.max_kv_size}")
        k = self.num_draft_tokens
        if k != AUTO_WIDTH and not (isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= MAX_DRAFT_TOKENS):
            raise UserError(f"num_draft_tokens must be from 1 to {MAX_DRAFT_TOKENS} or auto, got {k!r}")
        if not (isinstance(self.prompt_lookup_ngram, int) and 0 <= self.prompt_lookup_ngram <= MAX_LOOKUP_NGRAM):
            raise UserError(f"prompt_lookup_ngram must be from 0 (off) to {MAX_LOOKUP_NGRAM}, "
                            f"got {self.prompt_lookup_ngram}")
        if self.completion_batch_size is not None and not self.completion_batch_size >= 1:
            raise UserError(f"completion_batch_size must be >= 1, got {self.completion_batch_size}")

    def max_tokens_each(self, n: int) -> List[int]:
        """``max_tokens`` for each of ``n`` prompts."""
        return list(self.max_tokens) if isinstance(self.max_tokens, list) else [self.max_tokens] * n

    def sampler(self):
        from mlx_lm.sample_utils import make_sampler

        return make_sampler(self.temp, top_p=self.top_p, min_p=self.min_p, top_k=self.top_k)


# The commands rank 0 broadcasts (runtime/control.py encodes and checks them),
# each carried out by the CommandExecutor method of its name (commands/executor.py).

@dataclass
class LoadCommand(Command):
    """LOAD: load ``options.model`` on every rank."""

    op = control.LOAD
    options: LoadOptions


@dataclass
class GenerateCommand(Command):
    """GENERATE: ``prompts`` (token ids, one list per prompt) under ``sampling``.
    ``mode``: a loaded mode to run a batch with (None: auto's choice);
    ``batch``: one batch response even for one prompt; ``verify_width``: the
    line saying how ``num_draft_tokens="auto"`` chose ``sampling``'s number
    (None: not chosen)."""

    op = control.GENERATE
    prompts: List[List[int]]
    sampling: GenerationParams
    mode: Optional[str] = None
    batch: bool = False
    verify_width: Optional[str] = None


@dataclass
class StatsCommand(Command):
    """STATS: every rank's counters. ``reset`` zeroes them after reading;
    ``collect`` switches per-expert load counting on or off (None: as it is);
    ``routing`` adds this rank's share of the routed slots."""

    op = control.STATS
    reset: bool = False
    collect: Optional[bool] = None
    routing: bool = False


@dataclass
class ProbeCommand(Command):
    """PROBE: the probe registered as ``name`` (``executor.register_probe``), called with ``args``."""

    op = control.PROBE
    name: str
    args: Dict[str, Any] = field(default_factory=dict)


@dataclass
class ServeCommand(Command):
    """SERVE: the HTTP server's options (``serving/server.py``); every rank serves until rank 0 stops."""

    op = control.SERVE
    options: Dict[str, Any]


@dataclass
class PlaceCommand(Command):
    """PLACE: every rank holds ``placement``'s experts (a placement's JSON object) from now on."""

    op = control.PLACE
    placement: Dict[str, Any]


@dataclass
class ShutdownCommand(Command):
    """SHUTDOWN: every rank other than 0 exits with ``exit_code``."""

    op = control.SHUTDOWN
    exit_code: int = 0
