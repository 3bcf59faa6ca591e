"""The doctor's fit check: whether the model fits each rank, reckoned by
``model/fit.py``'s ``plan_fit`` exactly as a load with the same options
reckons it (the memory each rank finds, or ``--rank-memory``; the dispatch
mode's dense ranks; the model's own KV cache for ``--kv-reserve-tokens``),
so the doctor passes what loads and refuses what a load refuses.

The first rank that has the model builds mlx-lm's lazy model (sizes only:
nothing is read but the safetensors headers) and shares its lines.
"""

from pathlib import Path
from typing import Any, Dict, List, Optional

from mlxdist.errors import MlxdistError, one_line


def fit_problems(world, ranks: List[Dict[str, Any]], args) -> List[str]:
    """One line per rank the model does not fit (the load's refusal), on
    every rank alike. ``ranks``: every rank's facts; ``args``: the doctor's
    ``mode``, ``rank_memory``, ``kv_reserve_tokens``, ``expert_capacity``,
    ``memory_budget``."""
    from mlxdist.model.fit import RankMemory

    try:
        mine = RankMemory.here(world.rank)
    except Exception as e:  # noqa: BLE001 - unknown memory is not checked, as at load
        mine = RankMemory(0, f"unknown ({one_line(e)})")
    memory = [RankMemory.from_json(m) for m in world.control.allgather_json(mine.to_json())]
    present = [r["rank"] for r in ranks if r["model"] is not None and r["model"]["present"]]
    lines: Optional[List[str]] = None
    if present and world.rank == present[0]:
        try:
            lines = _lines(Path(ranks[world.rank]["model"]["where"]), memory, args)
        except MlxdistError as e:
            lines = [str(e)]
        except Exception as e:  # noqa: BLE001 - any failure is this rank's to report, never a hang
            lines = [f"rank {world.rank} could not check the fit: {one_line(e)}"]
    return next((found for found in world.control.allgather_json(lines) if found is not None), [])


def _lines(path: Path, memory, args) -> List[str]:
    from mlxdist.dispatch import modes
    from mlxdist.model.budgets import budgets_for_ranks
    from mlxdist.model.checkpoint import find_switch_sites
    from mlxdist.ship.locate import check_config, read_safetensors_index
    from mlxdist.errors import UserError
    from mlxdist.model.fit import KvReserve, ModelWeights, budget_fit, cache_cost, plan_fit
    from mlxdist.model.paging import capacity_for_budget
    from mlxdist.model.sources import load_lazy

    check_config(path)
    model, config, _ = load_lazy(path, read_safetensors_index(path))
    sites = find_switch_sites(model)
    if not sites:
        return []
    budgets = None
    if args.rank_memory is not None:
        budgets = budgets_for_ranks(args.rank_memory, [m.host for m in memory])
    runs_dense = [modes.runs_dense(args.mode, r) for r in range(len(memory))]
    kv = KvReserve(args.kv_reserve_tokens, cache_cost(model, config))
    if args.expert_capacity is not None and args.memory_budget is not None:
        raise UserError("give --expert-capacity or --memory-budget, not both")
    checked = args.expert_capacity is None and args.memory_budget is None and all(m.bytes for m in memory)
    weights = ModelWeights.of(model, sites)
    plan, fits = plan_fit(memory, weights, runs_dense, kv, None, True, budgets, args.expert_capacity, checked)
    if args.memory_budget is not None:  # each rank's capacity from what its dense part leaves, as at load
        capacity = [capacity_for_budget(args.memory_budget * 1e9, model, sites, d) for d in runs_dense]
        fits = [] if budgets is None else [budget_fit(plan, r, budgets[r], weights.per_expert, capacity[r])
                                           for r in range(len(memory))]
    return [f.refusal() for f in fits if not f.fits]
