"""``auto``'s rule: which modes a load of a mode builds
(``modes_to_load``), and which of them runs a generation of b sequences:
without a measured link, the rule measured on one host (``choose``,
``auto_mode``); with one, the cheapest step over it
(``auto_choice``, ``linkcost.py``). The one place besides ``dispatch/``
where a mode's name decides anything.
"""

from typing import List

from mlxdist.decide.linkcost import AutoInputs, Choice, cheapest
from mlxdist.dispatch.modes import mode
from mlxdist.errors import UserError

ROW_MODES = ("dp", "replicas")  # each rank its own sequences (``RowDispatcher``)

# Rows per rank from which ``auto`` runs dp. On GPUs a decode step is bound
# by the host's cost per graph node and dp with whole experts adds nodes per
# MoE layer; on CPUs dp wins once every rank has one row
# (docs/notes/auto-rows-per-rank.md).
AUTO_DP_ROWS_PER_RANK = {"mpi": 1, "nccl": 8}



def modes_to_load(name: str, by_width: bool, backend: str, shardable: bool, everywhere: bool = False,
               exact: bool = False) -> List[str]:
    """The modes a load of mode ``name`` builds, the first the default:
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
    """Whether one of these modes runs the dense model split by mlx-lm's ``shard()`` (on a twin)."""
    return "collective-tp" in names


def uses_router_weights(names: List[str]) -> bool:
    """Whether one of these modes needs each block's router weights found at load."""
    return "dp" in names


def without_router_weights(name: str, names: List[str], reason: UserError) -> List[str]:
    """The modes left when the blocks' router weights cannot be found:
    ``dp`` itself fails with ``reason``; ``auto`` runs collective for every batch."""
    if name == "dp":
        raise reason
    return [n for n in names if n != "dp"] or ["collective"]


def dp_rows_per_rank(backend: str, expert_split: str, rows: str = "dp") -> int:
    """Rows per rank from which ``auto`` may run its ``rows`` mode (dp or
    replicas): replicas and dp with experts cut in width from one, dp with
    whole experts from ``AUTO_DP_ROWS_PER_RANK`` for the transport (replicas
    add no graph node to a step, so GPUs' cost per node does not hold them
    back)."""
    return 1 if rows == "replicas" or expert_split == "width" else AUTO_DP_ROWS_PER_RANK.get(backend, 1)


def row_mode(loaded: List[str]) -> str:
    """The loaded mode in which each rank runs its own sequences (dp when none is)."""
    return next((s for s in loaded if s in ROW_MODES), "dp")


def auto_mode(batch: int, ranks: int, backend: str, expert_split: str = "whole", rows: str = "dp") -> str:
    """``auto``'s choice on a fast link (one host's, ``linkcost.LOCAL``) for
    a generation of ``batch`` sequences: the ``rows`` mode (dp, or
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
    """``auto``'s choice among the ``loaded`` modes from the measured
    link and the model's shapes (``linkcost.cheapest``), on either side of
    the threshold measured on one host (``dp_rows_per_rank``): from it, dp or
    collective (fewer collectives; collective-tp puts no fewer collectives or
    bytes on the wire than dp); below it, the collective modes (exact
    with whole experts, where dp's ranks would idle), and replicas where
    every rank holds every expert and the link costs the collective ones more
    than running alone costs (``linkcost``'s docstring). Replicas stand where
    dp does. Ties go to ``auto_mode``'s choice."""
    rows = row_mode(loaded)
    fast = auto_mode(batch, ranks, backend, expert_split, rows)
    fast = fast if fast in loaded else loaded[0]
    if batch >= ranks * dp_rows_per_rank(backend, expert_split, rows):
        return cheapest([s for s in loaded if s in (rows, "collective")], fast, batch, ranks, expert_split, inputs)
    return cheapest([s for s in loaded if s not in ROW_MODES], fast, batch, ranks, expert_split, inputs,
                    alone="replicas" in loaded)


def choose(name: str, loaded: List[str], batch: int, ranks: int, backend: str, expert_split: str) -> str:
    """Which of the ``loaded`` modes runs a generation of ``batch``
    sequences without a measured link: ``auto``'s fast-link rule; ``dp`` for
    any batch of two or more. With a measured link ``auto`` is ``auto_choice``."""
    if len(loaded) == 1:
        return loaded[0]
    if name == "auto":
        choice = auto_mode(batch, ranks, backend, expert_split, row_mode(loaded))
        return choice if choice in loaded else loaded[0]
    return "dp" if batch >= 2 and "dp" in loaded else loaded[0]
