"""The dispatch modes a user picks (``--dispatch``), what each is, and which
strategy runs a batch: the one place a mode's name decides anything.

A mode builds one or more strategies (dispatchers) at load; ``auto`` and
``dp`` hold a data-parallel one for batches and a collective one (or two)
for single sequences, and ``choose`` picks between them per generation
(``auto``: ``auto_choice``, from the link the ranks measured at load and
``linkcost.py``'s estimate of each candidate's step).
"""

from dataclasses import dataclass
from typing import Dict, List, Tuple, Type

from mlxdist.dispatch.base import Dispatcher
from mlxdist.dispatch.collective import CollectiveDispatcher
from mlxdist.dispatch.dataparallel import DataParallelDispatcher
from mlxdist.dispatch.linkcost import AutoInputs, Choice, cheapest
from mlxdist.dispatch.p2p import P2PDispatcher
from mlxdist.dispatch.replicas import ReplicaDispatcher
from mlxdist.errors import UserError


@dataclass(frozen=True)
class Mode:
    """One ``--dispatch`` choice: what it can run with (the strategies
    themselves declare the rest: ``base.Dispatcher``)."""

    name: str
    summary: str  # one line for --help
    builds: Tuple[str, ...] = ()  # the strategies a load of it may build (``strategies``); () for its own name alone
    takes_width: bool = True  # runs with --expert-split width
    routing_on_host: bool = False  # reads the routing back per layer whatever the layout (can page experts)
    mlx_collectives: bool = True  # its exchange runs on MLX's collectives (else: mpi4py's sends)
    dense_on_root: bool = False  # rank 0 alone runs the dense model (the others hold experts only)
    measures_link: bool = False  # chooses among its strategies from the link measured at load (auto_choice)
    replicates: bool = False  # may hold every expert on every rank and run batches as replicas (--replicate)
    cuts_experts: bool = False  # --expert-split auto may cut its experts in width (dispatch/splitcost.py)
    exact: bool = False  # bit-exact against one process with whole experts, at every batch

    @property
    def survives_rank_loss(self) -> bool:
        """Whether every strategy it may build goes on when a rank is lost
        (each declares it: ``Dispatcher.survives_rank_loss``)."""
        return all(STRATEGY_CLASSES[s].survives_rank_loss for s in self.builds or (self.name,))


MODES: Dict[str, Mode] = {m.name: m for m in (
    Mode("auto", "per generation, the strategy whose decode step costs the least over the link measured at load: "
                 "on a fast link dp for batches of at least one sequence per rank (8 on NCCL with whole experts), "
                 "else collective; where every rank has room for the whole model, every rank holds every expert "
                 "and such batches run as N replicas (no exchange); experts whole or cut in width, as weighed at load",
         builds=("collective", "collective-tp", "dp", "replicas"), measures_link=True, replicates=True,
         cuts_experts=True),
    Mode("dp", "each rank its own sequences, per-token combine (not bit-exact)", builds=("collective", "dp")),
    Mode("collective", "every rank runs the dense model, one all_sum of the slots per layer (exact)", exact=True),
    Mode("collective-tp", "collective with attention split by mlx-lm's shard() (not bit-exact)"),
    Mode("p2p", "rank 0 runs the dense model, workers hold experts only (exact; survives a lost rank)",
         takes_width=False, routing_on_host=True, mlx_collectives=False, dense_on_root=True,
         exact=True),
)}
DISPATCH_MODES = tuple(MODES)
# What a load may build: every mode's strategy but auto's own name, and
# ``replicas``, which auto builds in place of dp where every rank holds every
# expert (``replicas.py``; no user picks it by name).
STRATEGIES = DISPATCH_MODES[1:] + ("replicas",)
ROW_STRATEGIES = ("dp", "replicas")  # each rank its own sequences (``RowDispatcher``)
# Each strategy's class, which declares what it is (``base.Dispatcher``).
STRATEGY_CLASSES: Dict[str, Type[Dispatcher]] = {
    "collective": CollectiveDispatcher, "collective-tp": CollectiveDispatcher, "dp": DataParallelDispatcher,
    "replicas": ReplicaDispatcher, "p2p": P2PDispatcher}

# Rows per rank from which ``auto`` runs dp. On GPUs a decode step is bound
# by the host's cost per graph node and dp with whole experts adds nodes per
# MoE layer; on CPUs dp wins once every rank has one row
# (docs/notes/auto-rows-per-rank.md).
AUTO_DP_ROWS_PER_RANK = {"mpi": 1, "nccl": 8}


def mode(name: str) -> Mode:
    if name not in MODES:
        raise UserError(f"unknown dispatch mode {name!r} (choose {', '.join(DISPATCH_MODES)})")
    return MODES[name]


def runs_dense(name: str, rank: int) -> bool:
    """Whether ``rank`` runs the dense model under mode ``name`` (before its dispatchers exist)."""
    return rank == 0 or not mode(name).dense_on_root


def check_options(name: str, layout: str, expert_split: str, pages: bool, placed: bool) -> None:
    """Refuse combinations a mode cannot run, in one line each. ``pages``:
    --expert-capacity or --memory-budget; ``placed``: a placement or
    --no-rank0-experts given."""
    m = mode(name)
    if expert_split == "width":
        if not m.takes_width:
            runs = [n for n, other in MODES.items() if other.takes_width]
            raise UserError(f"--expert-split width runs with --dispatch {', '.join(runs[:-1])} or {runs[-1]}, "
                            f"not {name}")
        if pages or placed:
            raise UserError("--expert-split width holds every expert on every rank, cut in width: "
                            "it takes no placement, --no-rank0-experts, --expert-capacity or --memory-budget")
    if pages and not (m.routing_on_host or layout == "compact"):
        hosts = " or ".join(f"--dispatch {n}" for n, other in MODES.items() if other.routing_on_host)
        raise UserError(f"--expert-capacity pages experts by the routing read back on the host: "
                        f"use --layout compact or {hosts}")


def check_exact(name: str, expert_split: str, replicate: str) -> None:
    """``--exact`` (every batch bit-exact) runs where a mode can keep it:
    the exact modes as they are, ``auto`` restricted to ``collective`` with
    whole experts (``strategies``)."""
    m = mode(name)
    if not (m.exact or m.measures_link):
        able = ", ".join(n for n, other in MODES.items() if other.exact or other.measures_link)
        raise UserError(f"--exact keeps every batch bit-exact: it runs with --dispatch {able}, not {name} "
                        f"(not bit-exact)")
    if expert_split == "width":
        raise UserError("--exact needs whole experts: --expert-split width adds partial sums over the ranks")
    if replicate == "always":
        raise UserError("--exact runs every batch through collective: it takes no --replicate always "
                        "(replicas decode another batch shape than one process)")


def check_survival(name: str, ranks: int, tolerant: bool) -> None:
    """A job launched to survive a lost rank must run a mode that can."""
    if tolerant and ranks > 1 and not mode(name).survives_rank_loss:
        able = ", ".join(n for n, m in MODES.items() if m.survives_rank_loss)
        raise UserError(f"launch/mpirun --survive (in-job survival of a lost rank) needs --dispatch {able}; "
                        f"{name} runs MLX's collectives, which a lost rank stops")


def check_launcher(name: str, ranks: int, has_mpi: bool) -> None:
    """A mode whose exchange is mpi4py's needs MPI's launcher: under
    mlx.launch (no MPI) the control plane is MLX's and there is no MPI."""
    if ranks > 1 and not has_mpi and not mode(name).mlx_collectives:
        able = ", ".join(n for n, m in MODES.items() if m.mlx_collectives)
        raise UserError(f"--dispatch {name} exchanges experts over MPI, which mlx.launch does not start: "
                        f"launch with mpirun (launch/mpirun -np N), or use --dispatch {able}")


def strategies(name: str, by_width: bool, backend: str, shardable: bool, everywhere: bool = False,
               exact: bool = False) -> List[str]:
    """The strategies a load of mode ``name`` builds, the first the default:
    ``auto`` and ``dp`` hold collective and dp; ``auto`` with every expert
    on every rank (``everywhere``) holds collective and replicas, and
    collective-tp beside them where mlx-lm can ``shard()`` the model and the
    transport is not NCCL; ``auto`` with experts cut in width on MPI runs
    single sequences as collective-tp where mlx-lm can ``shard()`` the model
    (on a twin of it: ``splits_attention``), or as collective where the link
    makes its fewer collectives cheaper. (On NCCL's GPUs a step is bound by
    the host's time per graph node, which the cost model does not see.)
    ``exact`` (--exact): ``auto`` holds collective alone."""
    if name not in ("auto", "dp"):
        return [name]
    if exact:
        return ["collective"]
    if mode(name).replicates and everywhere and not by_width:
        splits = shardable and splits_one_sequence(backend, "whole", "replicas")
        return ["collective", "collective-tp", "replicas"] if splits else ["collective", "replicas"]
    if name == "auto" and by_width and backend == "mpi" and shardable:
        return ["collective-tp", "collective", "dp"]
    return ["collective", "dp"]


def splits_dense(names: List[str]) -> bool:
    """Whether one of these strategies runs the dense model split by mlx-lm's ``shard()`` (on a twin)."""
    return "collective-tp" in names


def uses_router_weights(names: List[str]) -> bool:
    """Whether one of these strategies needs each block's router weights found at load."""
    return "dp" in names


def without_router_weights(name: str, names: List[str], reason: UserError) -> List[str]:
    """The strategies left when the blocks' router weights cannot be found:
    ``dp`` itself fails with ``reason``; ``auto`` runs collective for every batch."""
    if name == "dp":
        raise reason
    return [n for n in names if n != "dp"] or ["collective"]


def dp_rows_per_rank(backend: str, expert_split: str, rows: str = "dp") -> int:
    """Rows per rank from which ``auto`` may run its ``rows`` strategy (dp or
    replicas): replicas and dp with experts cut in width from one, dp with
    whole experts from ``AUTO_DP_ROWS_PER_RANK`` for the transport (replicas
    add no graph node to a step, so GPUs' cost per node does not hold them
    back)."""
    return 1 if rows == "replicas" or expert_split == "width" else AUTO_DP_ROWS_PER_RANK.get(backend, 1)


def row_strategy(loaded: List[str]) -> str:
    """The loaded strategy in which each rank runs its own sequences (dp when none is)."""
    return next((s for s in loaded if s in ROW_STRATEGIES), "dp")


def auto_strategy(batch: int, ranks: int, backend: str, expert_split: str = "whole", rows: str = "dp") -> str:
    """``auto``'s choice on a fast link (one host's, ``linkcost.LOCAL``) for
    a generation of ``batch`` sequences: the ``rows`` strategy (dp, or
    replicas where every rank holds every expert) once the batch gives every
    rank enough rows (``dp_rows_per_rank``), a collective one below: with
    experts cut in width on MPI, or every expert on every rank (replicas)
    off NCCL, collective-tp (attention split as tensor parallelism splits
    it: half the dense work a rank on two; where the model has no mlx-lm
    ``shard()`` the engine runs collective)."""
    if batch >= ranks * dp_rows_per_rank(backend, expert_split, rows):
        return rows
    return "collective-tp" if splits_one_sequence(backend, expert_split, rows) else "collective"


def splits_one_sequence(backend: str, expert_split: str, rows: str) -> bool:
    """Whether ``auto`` runs one sequence with the dense part split
    (collective-tp, where the model has mlx-lm's ``shard()``): with experts
    cut in width on MPI, or with every expert on every rank (``rows`` is
    replicas) off NCCL, whose GPUs are bound by the host's time per graph node."""
    return (expert_split == "width" and backend == "mpi") or (rows == "replicas" and backend != "nccl")


def auto_choice(loaded: List[str], batch: int, ranks: int, backend: str, expert_split: str,
                inputs: AutoInputs) -> Choice:
    """``auto``'s choice among the ``loaded`` strategies from the measured
    link and the model's shapes (``linkcost.cheapest``), on either side of
    the threshold measured on one host (``dp_rows_per_rank``): from it, dp or
    collective (fewer collectives; collective-tp puts no fewer collectives or
    bytes on the wire than dp); below it, the collective strategies (exact
    with whole experts, where dp's ranks would idle), and replicas where
    every rank holds every expert and the link costs the collective ones more
    than running alone costs (``linkcost``'s docstring). Replicas stand where
    dp does. Ties go to ``auto_strategy``'s choice."""
    rows = row_strategy(loaded)
    fast = auto_strategy(batch, ranks, backend, expert_split, rows)
    fast = fast if fast in loaded else loaded[0]
    if batch >= ranks * dp_rows_per_rank(backend, expert_split, rows):
        return cheapest([s for s in loaded if s in (rows, "collective")], fast, batch, ranks, expert_split, inputs)
    return cheapest([s for s in loaded if s not in ROW_STRATEGIES], fast, batch, ranks, expert_split, inputs,
                    alone="replicas" in loaded)


def choose(name: str, loaded: List[str], batch: int, ranks: int, backend: str, expert_split: str) -> str:
    """Which of the ``loaded`` strategies runs a generation of ``batch``
    sequences without a measured link: ``auto``'s fast-link rule; ``dp`` for
    any batch of two or more. With a measured link ``auto`` is ``auto_choice``."""
    if len(loaded) == 1:
        return loaded[0]
    if name == "auto":
        choice = auto_strategy(batch, ranks, backend, expert_split, row_strategy(loaded))
        return choice if choice in loaded else loaded[0]
    return "dp" if batch >= 2 and "dp" in loaded else loaded[0]


def help_text() -> str:
    """The modes, one clause each, for ``--dispatch``'s help."""
    return "; ".join(f"{m.name}: {m.summary}" for m in MODES.values())
