"""Whether a model fits each rank's memory: the one check the load and the
doctor make (docs/memory.md).

A rank needs the weights it holds (its dense part where it runs the dense
model, its experts) and a KV-cache reserve where it runs attention; it has
the memory it found (``runtime/memory.py``: Metal's recommended working set,
the figure mlx-lm wires, on a Mac) less ``MARGIN`` for activations, buffers
and the system. ``--rank-memory`` budgets, given by hand, count expert
weights only and replace that reckoning.

The KV reserve is what mlx-lm's ``make_prompt_cache(model)`` would hold for
``--kv-reserve-tokens`` tokens: the model's lazy forward is run on one and on
two tokens of zeros (nothing is evaluated, nothing read), and what each layer
writes into its cache per token is recorded. MLA latents, sliding windows
(a ``RotatingKVCache`` keeps at most its window) and constant-size states
(``ArraysCache``: linear attention, Mamba) come out as the model makes them,
with no per-model code. Where that cannot run, the config's layers, KV heads
and head size give the figure, and the reserve says so.

Notation: N ranks, T reserved tokens.
"""

import argparse
import contextlib
import io
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxdist.config import KV_RESERVE_TOKENS, kv_reserve_tokens_arg
from mlxdist.errors import UserError, one_line
from mlxdist.model.balance import bytes_per_expert
from mlxdist.model.checkpoint import find_switch_sites, nbytes, text_config
from mlxdist.values.placement import Placement, resolve_placement

MARGIN = 0.10  # of each rank's memory, kept free for activations, buffers and the system
WIRED_SHARE = 0.90  # of a Mac's memory, the GPU wired limit suggested where Metal's figure is short
_FORMULA_BYTES = 2  # bytes a cached value takes in the config's formula (bf16)
MEASURED = "mlx-lm's make_prompt_cache"  # CacheCost.source where measured on the model


@dataclass(frozen=True)
class CacheCost:
    """Bytes of mlx-lm's prompt cache for one sequence of T tokens:
    ``constant`` + sum over ``growing`` of (bytes a token adds) x min(T, the
    most tokens that cache keeps, None: all). ``source``: how it was found."""

    growing: Tuple[Tuple[int, Optional[int]], ...]
    constant: int
    source: str

    def bytes_for(self, tokens: int) -> int:
        return self.constant + sum(per * (tokens if cap is None else min(tokens, cap)) for per, cap in self.growing)

    @property
    def measured(self) -> bool:
        """Measured on the model, not the config's formula."""
        return self.source == MEASURED

    @property
    def bytes_per_token(self) -> int:
        """Bytes each token adds in the caches that keep every token (the long-context cost)."""
        return sum(per for per, cap in self.growing if cap is None)


def cache_cost(model: nn.Module, config: Dict[str, Any]) -> CacheCost:
    """What ``make_prompt_cache(model)`` holds per token, measured on the
    lazy ``model`` (see the module's docstring); the config's formula where
    that cannot run, saying why in ``source``."""
    try:
        one, two = _record(model, 1), _record(model, 2)
    except Exception as e:  # noqa: BLE001 - any model whose forward cannot run here: the formula
        return config_cache_cost(config, f"mlx-lm's cache could not be measured: {one_line(e)}")
    if len(one) != len(two) or any(b != (2 * p, c, k) for (p, c, k), b in zip(one, two)):
        return config_cache_cost(config, "mlx-lm's cache did not grow linearly over one and two tokens")
    growing = tuple((per, cap) for per, cap, _ in one if per)
    return CacheCost(growing, sum(const for _, _, const in one), MEASURED)


def _record(model: nn.Module, tokens: int) -> List[Tuple[int, Optional[int], int]]:
    """Per cache of the model (a ``CacheList``'s parts each): (bytes written
    into it by a forward of ``tokens`` zeros, the most tokens it keeps, the
    bytes of a cache that nothing is written into token by token)."""
    from mlx_lm.models.cache import make_prompt_cache

    top = make_prompt_cache(model)
    leaves = _leaves(top)
    written = [0] * len(leaves)
    for i, leaf in enumerate(leaves):
        if hasattr(leaf, "update_and_fetch"):
            leaf.update_and_fetch = _counting(leaf.update_and_fetch, written, i)
    model(mx.zeros((1, tokens), dtype=mx.int32), cache=top)  # lazy: nothing evaluated
    out = []
    for i, leaf in enumerate(leaves):
        cap = getattr(leaf, "max_size", None) or getattr(leaf, "chunk_size", None)
        constant = 0 if hasattr(leaf, "update_and_fetch") else sum(
            v.nbytes for _, v in tree_flatten(leaf.state) if isinstance(v, mx.array))
        out.append((written[i], cap, constant))
    return out


def _leaves(caches: Sequence[Any]) -> List[Any]:
    """The caches of a prompt cache, a ``CacheList``'s parts each on their own."""
    return [leaf for c in caches for leaf in (_leaves(c.caches) if hasattr(c, "caches") else [c])]


def _counting(update, written: List[int], i: int):
    def update_and_fetch(*arrays, **kwargs):
        written[i] += sum(a.nbytes for a in arrays if isinstance(a, mx.array))
        return update(*arrays, **kwargs)

    return update_and_fetch


def config_cache_cost(config: Dict[str, Any], why: str) -> CacheCost:
    """The config's formula, every layer keeping every token at 2 bytes a
    value: MLA (``kv_lora_rank``) latent and rope key, else keys and values
    of its KV heads."""
    cfg = text_config(config)
    layers = int(cfg.get("num_hidden_layers") or cfg.get("n_layers") or 1)
    heads = int(cfg.get("num_attention_heads") or cfg.get("n_heads") or 1)
    if cfg.get("kv_lora_rank"):
        values = int(cfg["kv_lora_rank"]) + int(cfg.get("qk_rope_head_dim") or 0)
    else:
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        hidden = int(cfg.get("hidden_size") or cfg.get("d_model") or 0)
        values = 2 * kv_heads * int(cfg.get("head_dim") or (hidden // heads if heads else 0))
    return CacheCost(((layers * values * _FORMULA_BYTES, None),), 0, f"the config's formula ({why})")


@dataclass(frozen=True)
class RankMemory:
    """What one rank has: ``bytes`` (from ``source``), its host, its
    machine's whole memory and whether it is a Mac (for the wired limit)."""

    bytes: int
    source: str
    host: str = "?"
    machine_bytes: Optional[int] = None
    mac: bool = False

    @classmethod
    def here(cls, rank: int) -> "RankMemory":
        """This rank's, as the load finds it."""
        import socket

        from mlxdist.runtime.memory import detect_memory

        found, source = detect_memory(rank)
        return cls(found, source, socket.gethostname(), _machine_bytes(), sys.platform == "darwin")

    def to_json(self) -> Dict[str, Any]:
        return {"bytes": self.bytes, "source": self.source, "host": self.host, "machine_bytes": self.machine_bytes,
                "mac": self.mac}

    @classmethod
    def from_json(cls, obj: Dict[str, Any]) -> "RankMemory":
        return cls(int(obj["bytes"]), str(obj["source"]), str(obj["host"]), obj.get("machine_bytes"), bool(obj["mac"]))


def _machine_bytes() -> Optional[int]:
    size = mx.device_info().get("memory_size") if mx.metal.is_available() else None
    if size:
        return int(size)
    if sys.platform == "darwin":
        out = subprocess.run(["sysctl", "-n", "hw.memsize"], capture_output=True, text=True, timeout=10)
        return int(out.stdout) if out.stdout.strip().isdigit() else None
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    except (OSError, StopIteration):
        return None


def wired_limit_mb(memory: RankMemory) -> Optional[int]:
    """The ``iogpu.wired_limit_mb`` to suggest for a Mac: ``WIRED_SHARE`` of
    its memory (MLX: keep it below the machine's memory), where that raises
    the figure the rank found; None elsewhere."""
    if not memory.mac or not memory.machine_bytes:
        return None
    limit = int(memory.machine_bytes * WIRED_SHARE) // 2**20
    return limit if limit * 2**20 > memory.bytes else None


@dataclass(frozen=True)
class ModelWeights:
    """Bytes of a model's weights: outside its routed experts, and one expert's per MoE layer."""

    dense: int
    per_expert: Dict[int, float]
    experts_per_layer: Dict[int, int]

    @classmethod
    def of(cls, model: nn.Module, sites) -> "ModelWeights":
        """From mlx-lm's lazy model (sizes, no reads)."""
        per_expert = bytes_per_expert(sites)
        experts = int(sum(per_expert[s.layer] * s.num_experts for s in sites))
        return cls(nbytes(model.parameters()) - experts, per_expert, {s.layer: s.num_experts for s in sites})


@dataclass(frozen=True)
class KvReserve:
    """T tokens of the model's cache, reserved on every rank that runs attention."""

    tokens: int
    cost: CacheCost

    @property
    def bytes(self) -> int:
        return self.cost.bytes_for(self.tokens)


@dataclass(frozen=True)
class RankFit:
    """One rank's need against what it has. ``by_hand``: a ``--rank-memory``
    budget (expert weights only: no dense part, KV reserve or margin)."""

    rank: int
    memory: RankMemory
    dense: int
    experts: float
    held: int  # experts it keeps resident, over every layer
    kv: int
    kv_tokens: int
    by_hand: bool = False
    kv_source: str = MEASURED

    @property
    def need(self) -> float:
        return self.dense + self.experts + self.kv

    @property
    def has(self) -> float:
        return self.memory.bytes if self.by_hand else self.memory.bytes * (1 - MARGIN)

    @property
    def fits(self) -> bool:
        return self.need <= self.has

    def refusal(self) -> str:
        """One line: the rank, the numbers and the ways out."""
        gb = lambda b: f"{b / 1e9:.3g}"  # noqa: E731
        where = f"rank {self.rank}" + ("" if self.memory.host == "?" else f" (host {self.memory.host})")
        if self.by_hand:  # the wording of model/balance.py's check before this module
            return (f"rank {self.rank} holds {self.held} experts: {gb(self.need)} GB of expert weights, over its "
                    f"--rank-memory {gb(self.has)} GB by {gb(self.need - self.has)} GB: the model does not fit. Ways "
                    f"out: a larger --rank-memory, more ranks, or page experts from disk with --expert-capacity N")
        formula = "" if self.kv_source == MEASURED else f" ({self.kv_source})"
        line = (f"{where} needs {gb(self.need)} GB = weights {gb(self.dense + self.experts)} GB (dense "
                f"{gb(self.dense)} GB + {self.held} experts {gb(self.experts)} GB) + KV {gb(self.kv)} GB for "
                f"{self.kv_tokens} tokens{formula}; has {gb(self.has)} GB ({gb(self.memory.bytes)} GB from "
                f"{self.memory.source}, less a {MARGIN:.0%} margin): the model does not fit. Ways out: more ranks, "
                f"--rank-memory (expert budgets by hand), page experts from disk with --expert-capacity N, "
                f"reserve fewer KV tokens with --kv-reserve-tokens N")
        limit = wired_limit_mb(self.memory)
        if limit is not None:
            line += (f", or raise the GPU's wired limit on that Mac (docs/memory.md): "
                     f"sudo sysctl iogpu.wired_limit_mb={limit}")
        return line


def expert_rooms(memory: Sequence[RankMemory], weights: ModelWeights, runs_dense: Sequence[bool],
                 kv: KvReserve) -> List[float]:
    """[N] bytes each rank can give its experts (may be 0 or less): its
    memory less the margin, and its dense part and KV reserve where it runs the dense model."""
    return [m.bytes * (1 - MARGIN) - (weights.dense + kv.bytes if d else 0) for m, d in zip(memory, runs_dense)]


def rank_fits(plan: Placement, memory: Sequence[RankMemory], weights: ModelWeights, runs_dense: Sequence[bool],
              kv: KvReserve, capacity: Optional[int] = None, budgets_gb: Optional[Sequence[float]] = None
              ) -> List[RankFit]:
    """[N] each rank's fit under ``plan``: at most ``capacity`` experts a
    layer resident where paging; against ``budgets_gb`` (``--rank-memory``,
    expert weights only) where given, else against ``memory``."""
    if budgets_gb is not None:
        return [budget_fit(plan, rank, budgets_gb[rank], weights.per_expert, capacity, mem.host)
                for rank, mem in enumerate(memory)]
    fits = []
    for rank, mem in enumerate(memory):
        held, experts = _resident(plan, rank, weights.per_expert, capacity)
        dense = runs_dense[rank]
        fits.append(RankFit(rank, mem, weights.dense if dense else 0, experts, held, kv.bytes if dense else 0,
                            kv.tokens, kv_source=kv.cost.source))
    return fits


def budget_fit(plan: Placement, rank: int, budget_gb: float, per_expert: Dict[int, float],
               capacity: Optional[int] = None, host: str = "?") -> RankFit:
    """``rank``'s fit under ``plan`` against its ``--rank-memory`` budget (expert weights only)."""
    held, experts = _resident(plan, rank, per_expert, capacity)
    return RankFit(rank, RankMemory(int(budget_gb * 1e9), "--rank-memory", host), 0, experts, held, 0, 0,
                   by_hand=True)


def _resident(plan: Placement, rank: int, per_expert: Dict[int, float], capacity: Optional[int]) -> Tuple[int, float]:
    """(experts, their bytes) ``rank`` keeps resident under ``plan``: per layer those it holds, at most ``capacity``."""
    held = {l: c[rank] if capacity is None else min(c[rank], capacity)
            for l, c in plan.held_counts(plan.num_ranks).items()}
    return sum(held.values()), sum(n * per_expert[l] for l, n in held.items())


def check_fits(fits: Sequence[RankFit]) -> None:
    """Raise ``UserError`` with the first rank's refusal that does not fit."""
    for fit in fits:
        if not fit.fits:
            raise UserError(fit.refusal())


def plan_fit(memory: Sequence[RankMemory], weights: ModelWeights, runs_dense: Sequence[bool], kv: KvReserve,
             placement: Optional[dict] = None, rank0_experts: bool = True,
             budgets_gb: Optional[Sequence[float]] = None, capacity: Optional[int] = None,
             checked: bool = True) -> Tuple[Placement, List[RankFit]]:
    """The placement a load takes and each rank's fit under it, as the
    load and the doctor both reckon it: a ``placement`` file as given, else
    the even policy in proportion to ``budgets_gb`` where given, else to
    each rank's room for experts where the ranks differ by more than 1 %.
    ``checked`` False (paging, experts cut in width, a rank's memory
    unknown): the measured memory is not checked (no fits) and does not place."""
    num_ranks = len(memory)
    if budgets_gb is not None:
        plan = resolve_placement(placement, weights.experts_per_layer, num_ranks, rank0_experts, list(budgets_gb))
        return plan, rank_fits(plan, memory, weights, runs_dense, kv, capacity, budgets_gb)
    if not checked:
        return resolve_placement(placement, weights.experts_per_layer, num_ranks, rank0_experts, None), []
    rooms = expert_rooms(memory, weights, runs_dense, kv)
    unequal = min(rooms) > 0 and rank0_experts and max(rooms) > 1.01 * min(rooms)
    plan = resolve_placement(placement, weights.experts_per_layer, num_ranks, rank0_experts,
                             [r / 1e9 for r in rooms] if unequal else None)
    return plan, rank_fits(plan, memory, weights, runs_dense, kv)


# The table of docs/memory.md: python -m mlxdist.model.fit --config C.json [C.json ...] --ranks 2,4 --gb 128,192,512

def model_from_config(config: Dict[str, Any], bits: Optional[int], group_size: int = 64) -> Tuple[nn.Module, Dict]:
    """mlx-lm's model of ``config``, lazy (nothing evaluated), in the
    config's dtype, quantized to ``bits`` as ``mlx_lm.convert -q`` does."""
    from mlx_lm.utils import quantize_model

    from mlxdist.compat import model_classes

    model_class, args_class = model_classes(config)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(getattr(mx, str(config.get("torch_dtype") or "bfloat16")))
    if bits is not None:
        with contextlib.redirect_stdout(io.StringIO()):
            model, config = quantize_model(model, config, group_size, bits)
    return model, config


def mac_memory(gb: int, share: float) -> RankMemory:
    """A Mac of ``gb`` GB (GiB, as Apple counts) whose GPU may use ``share`` of it."""
    machine = gb * 2**30
    return RankMemory(int(machine * share), f"{share:.0%} of {gb} GB", f"mac-{gb}", machine, True)


def table(configs: Sequence[Path], ranks: Sequence[int], gbs: Sequence[int], bits: Optional[int], tokens: int,
          shares: Sequence[float]) -> str:
    """The markdown table of each model's fit (every rank running the dense
    model, as collective does) on ranks x Macs of gbs GB, at each GPU share."""
    lines = []
    for path in configs:
        config = json.loads(Path(path).read_text())
        model, config = model_from_config(config, bits)
        sites = find_switch_sites(model)
        weights = ModelWeights.of(model, sites)
        kv = KvReserve(tokens, cache_cost(model, config))
        total = weights.dense + sum(weights.per_expert[l] * n for l, n in weights.experts_per_layer.items())
        lines += [f"**{Path(path).stem}** ({config.get('model_type')}, {bits or 'unquantized'}-bit): weights "
                  f"{total / 1e9:.1f} GB, of which dense {weights.dense / 1e9:.1f} GB; KV "
                  f"{kv.cost.bytes_per_token:,} bytes a token, {kv.bytes / 1e9:.2f} GB for {tokens:,} tokens "
                  f"({kv.cost.source})", "",
                  "| Macs | per rank: needs (weights + KV) | " + " | ".join(f"has: {s:.0%} of memory less {MARGIN:.0%}" for s in shares)
                  + " |", "|---|---|" + "---|" * len(shares)]
        for n in ranks:
            for gb in gbs:
                cells = []
                for share in shares:
                    memory = [mac_memory(gb, share)] * n
                    _, fits = plan_fit(memory, weights, [True] * n, kv)
                    worst = max(fits, key=lambda f: f.need - f.has)
                    cells.append(f"{worst.has / 1e9:.1f} GB: {'fits' if worst.fits else '**does not fit**'}")
                need = max(fits, key=lambda f: f.need)
                lines.append(f"| {n} x {gb} GB | {need.need / 1e9:.1f} GB ({(need.dense + need.experts) / 1e9:.1f}"
                             f" + {need.kv / 1e9:.2f}) | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def check_rank_memory(placement: Placement, rank: int, budget_gb: float, expert_bytes: Dict[int, float],
                      capacity: Optional[int] = None) -> float:
    """The GB of expert weights ``rank`` keeps resident under ``placement``
    (per layer: the experts it holds, or at most ``capacity`` of them when
    paging); raises ``UserError`` with ``check_fits``'s refusal when that
    exceeds its ``--rank-memory`` ``budget_gb``."""
    fit = budget_fit(placement, rank, budget_gb, expert_bytes, capacity)
    check_fits([fit])
    return fit.experts / 1e9


def main(argv=None) -> int:
    from mlxdist.inputs.digits import arg_int, parse_int, parse_number
    from mlxdist.errors import say_error

    p = argparse.ArgumentParser(prog="python -m mlxdist.model.fit", description=table.__doc__.split("\n")[0])
    p.add_argument("--config", nargs="+", required=True, help="config.json files (tests/configs/*.json)")
    p.add_argument("--ranks", default="2,4", help="numbers of Macs, comma-separated (default %(default)s)")
    p.add_argument("--gb", default="128,192,512", help="each Mac's memory in GB, comma-separated (default %(default)s)")
    p.add_argument("--bits", type=arg_int(1), default=4, help="quantized to this many bits (default %(default)s)")
    p.add_argument("--kv-reserve-tokens", type=kv_reserve_tokens_arg, default=KV_RESERVE_TOKENS, metavar="N",
                   help="KV-cache tokens reserved per rank (default %(default)s)")
    p.add_argument("--share", default="0.75,0.9", help="the GPU's share of each Mac's memory (default %(default)s)")
    args = p.parse_args(argv)
    try:
        ranks = [parse_int(x.strip(), "--ranks") for x in args.ranks.split(",")]
        gbs = [parse_int(x.strip(), "--gb") for x in args.gb.split(",")]
        shares = [parse_number(x.strip(), "--share", high=1, above=0) for x in args.share.split(",")]
        if min(ranks) < 1 or min(gbs) < 1 or max(ranks) > 1024 or max(gbs) > 1 << 20:
            raise ValueError("--ranks takes 1 to 1024 Macs, --gb 1 to 1048576 GB")
    except ValueError as e:
        say_error(str(e))
        return 2
    try:
        print(table(args.config, ranks, gbs, args.bits, args.kv_reserve_tokens, shares))
    except (OSError, ValueError, KeyError) as e:
        say_error(f"cannot build the table: {one_line(e)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
