"""The dispatch modes a user picks (``--mode``), what each is and the
option and launcher checks of each.

A mode loads one dispatcher per mode it may run; ``auto`` and
``dp`` hold a data-parallel one for batches and a collective one (or two)
for single sequences. Which it builds, and which runs each generation, is
decided in ``mlxdist/decide/`` (``rule.py``).
"""

from dataclasses import dataclass
from typing import Dict, Tuple, Type

from mlxdist.dispatch.base import Dispatcher
from mlxdist.dispatch.collective import CollectiveDispatcher
from mlxdist.dispatch.dataparallel import DataParallelDispatcher
from mlxdist.dispatch.p2p import P2PDispatcher
from mlxdist.dispatch.replicas import ReplicaDispatcher
from mlxdist.errors import UserError


@dataclass(frozen=True)
class Mode:
    """One ``--mode`` choice: what it can run with (the modes
    themselves declare the rest: ``base.Dispatcher``)."""

    name: str
    summary: str  # one line for --help
    builds: Tuple[str, ...] = ()  # the modes a load of it may build (``modes_to_load``); () for its own name alone
    takes_width: bool = True  # runs with --expert-split width
    reads_routing_back: bool = False  # reads the routing back per layer whatever the layout (can page experts)
    mlx_collectives: bool = True  # its exchange runs on MLX's collectives (else: mpi4py's sends)
    dense_on_root: bool = False  # rank 0 alone runs the dense model (the others hold experts only)
    measures_link: bool = False  # chooses among its modes from the link measured at load (auto_choice)
    replicates: bool = False  # may hold every expert on every rank and run batches as replicas (--replicate)
    cuts_experts: bool = False  # --expert-split auto may cut its experts in width (decide/splitcost.py)
    exact: bool = False  # bit-exact against one process with whole experts, at every batch

    @property
    def survives_rank_loss(self) -> bool:
        """Whether every mode it may build goes on when a rank is lost
        (each declares it: ``Dispatcher.survives_rank_loss``)."""
        return all(MODE_CLASSES[s].survives_rank_loss for s in self.builds or (self.name,))


MODES: Dict[str, Mode] = {m.name: m for m in (
    Mode("auto", "per generation, the mode whose decode step costs the least over the link measured at load: "
                 "on a fast link dp for batches of at least one sequence per rank (8 on NCCL with whole experts), "
                 "else collective; where every rank has room for the whole model, every rank holds every expert "
                 "and such batches run as N replicas (no exchange); experts whole or cut in width, as weighed at load",
         builds=("collective", "collective-tp", "dp", "replicas"), measures_link=True, replicates=True,
         cuts_experts=True),
    Mode("dp", "each rank its own sequences, per-token combine (not bit-exact)", builds=("collective", "dp")),
    Mode("collective", "every rank runs the dense model, one all_sum of the slots per layer (exact)", exact=True),
    Mode("collective-tp", "collective with attention split by mlx-lm's shard() (not bit-exact)"),
    Mode("p2p", "rank 0 runs the dense model, workers hold experts only (exact; survives a lost rank)",
         takes_width=False, reads_routing_back=True, mlx_collectives=False, dense_on_root=True,
         exact=True),
)}
DISPATCH_MODES = tuple(MODES)
# What a load may build: every mode's mode but auto's own name, and
# ``replicas``, which auto builds in place of dp where every rank holds every
# expert (``replicas.py``; no user picks it by name).
LOADABLE_MODES = DISPATCH_MODES[1:] + ("replicas",)
# Each mode's class, which declares what it is (``base.Dispatcher``).
MODE_CLASSES: Dict[str, Type[Dispatcher]] = {
    "collective": CollectiveDispatcher, "collective-tp": CollectiveDispatcher, "dp": DataParallelDispatcher,
    "replicas": ReplicaDispatcher, "p2p": P2PDispatcher}

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
            raise UserError(f"--expert-split width runs with --mode {', '.join(runs[:-1])} or {runs[-1]}, "
                            f"not {name}")
        if pages or placed:
            raise UserError("--expert-split width holds every expert on every rank, cut in width: "
                            "it takes no placement, --no-rank0-experts, --expert-capacity or --memory-budget")
    if pages and not (m.reads_routing_back or layout == "compact"):
        hosts = " or ".join(f"--mode {n}" for n, other in MODES.items() if other.reads_routing_back)
        raise UserError(f"--expert-capacity pages experts by the routing read back on the host: "
                        f"use --layout compact or {hosts}")


def check_exact(name: str, expert_split: str, replicate: str) -> None:
    """``--exact`` (every batch bit-exact) runs where a mode can keep it:
    the exact modes as they are, ``auto`` restricted to ``collective`` with
    whole experts (``modes_to_load``)."""
    m = mode(name)
    if not (m.exact or m.measures_link):
        able = ", ".join(n for n, other in MODES.items() if other.exact or other.measures_link)
        raise UserError(f"--exact keeps every batch bit-exact: it runs with --mode {able}, not {name} "
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
        raise UserError(f"launch/mpirun --survive (in-job survival of a lost rank) needs --mode {able}; "
                        f"{name} runs MLX's collectives, which a lost rank stops")


def check_launcher(name: str, ranks: int, has_mpi: bool) -> None:
    """A mode whose exchange is mpi4py's needs MPI's launcher: under
    mlx.launch (no MPI) the control plane is MLX's and there is no MPI."""
    if ranks > 1 and not has_mpi and not mode(name).mlx_collectives:
        able = ", ".join(n for n, m in MODES.items() if m.mlx_collectives)
        raise UserError(f"--mode {name} exchanges experts over MPI, which mlx.launch does not start: "
                        f"launch with mpirun (launch/mpirun -np N), or use --mode {able}")


def help_text() -> str:
    """The modes, one clause each, for ``--mode``'s help."""
    return "; ".join(f"{m.name}: {m.summary}" for m in MODES.values())
