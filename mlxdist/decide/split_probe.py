"""What ``--expert-split auto`` chooses from, measured at load before a byte
of the experts is read (``decide/splitcost.py`` chooses):

    experts  each rank times the expert products of one MoE layer as mlx-lm
             runs them (its switch layers' own ``__call__``: ``gather_qmm`` /
             ``gather_mm``, sorted by expert) on zero weights of the
             checkpoint's shapes, dtypes and quantization, for what a step
             of b rows gives the busiest rank: whole, the slots and distinct
             experts of the rank that got the most, at full width; width,
             every slot at 1/N of the width. Those counts are the mean over
             ``DRAWS`` steps of rows routed uniformly (K distinct experts a
             row) over the even placement. At most ``PROBE_EXPERTS`` experts
             are built; a step touching more is timed on that many with as
             many slots per expert, and scaled by the experts it touches (a
             product's cost is its expert's weights, read once);
    link     ``decide/costs.py``'s all_sum rounds;
    dense    not yet loaded, so estimated from its bytes: the dense linear
             layers' bytes times the seconds per byte the probe's experts
             took at one row and per row beyond it; the share ``shard()``
             would split is the decoder layers' linear layers (attention,
             dense and shared MLPs, not the routers) over all of them.

Every rank agrees on the largest figure of any rank, so every rank cuts alike.
"""

from typing import Dict, List, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from mlxdist.decide import traffic
from mlxdist.decide.linkcost import AutoInputs, DenseCost
from mlxdist.decide.splitcost import BATCHES, ExpertWork
from mlxdist.decide.costs import ROWS, fastest, link_cost, link_rounds
from mlxdist.model.balance import bytes_per_expert
from mlxdist.model.checkpoint import FROM_HIDDEN, SwitchSite, hidden_axis, projections
from mlxdist.errors import one_line
from mlxdist.runtime import faults
from mlxdist.runtime.agreement import agree
from mlxdist.runtime.world import World

__all__ = ["busiest_load", "dense_linear_bytes", "measure_split_inputs"]

DRAWS = 64  # simulated steps per batch size
PROBE_EXPERTS = 16  # most experts the probe builds


def busiest_load(owners: List[int], top_k: int, rows: int, ranks: int, cut: str) -> Tuple[float, float]:
    """(slots, distinct experts) of one MoE layer the busiest rank computes
    in a step of ``rows`` rows, each routed to ``top_k`` distinct experts
    uniformly, the mean over ``DRAWS`` steps (a fixed seed: every rank
    draws alike). ``owners``: each expert's rank (whole experts)."""
    rng = np.random.default_rng(0)
    chosen = rng.random((DRAWS, rows, len(owners))).argsort(axis=-1)[..., :top_k].reshape(DRAWS, -1)
    slots_sum = distinct_sum = 0.0
    for step in chosen:
        if cut == "width":
            slots, distinct = len(step), len(np.unique(step))
        else:
            per_rank = [step[np.asarray(owners)[step] == r] for r in range(ranks)]
            slots, distinct = max((len(c), len(np.unique(c))) for c in per_rank)
        slots_sum, distinct_sum = slots_sum + slots, distinct_sum + distinct
    return slots_sum / DRAWS, distinct_sum / DRAWS


def measure_split_inputs(world: World, site: SwitchSite, owners: List[int], shape: traffic.Shape,
                         dtype: mx.Dtype, dense_bytes: int, split_share: float) -> Tuple[AutoInputs, ExpertWork]:
    """The link, the dense work and the busiest rank's expert work for each
    cut and batch (see the module's docstring), agreed by every rank. A
    rank whose own probe fails still joins the link's collectives and the
    agreement on the figures, so every rank raises the same one line."""
    runs: List[Tuple[str, int, float, float]] = []
    for cut in ("whole", "width"):
        for b in BATCHES:
            slots, distinct = busiest_load(owners, shape.top_k, b, world.size, cut)
            runs.append((cut, b, slots, distinct))
    times, error = [], None
    try:
        faults.point("split", world.rank)
        times = _time_probes(site, runs, dtype, world.size)
    except Exception as e:  # noqa: BLE001 - anything mlx raises: reported by every rank below
        error = f"{one_line(e)} (--expert-split whole or width skips it)"
    small, step = link_rounds(world, shape, dtype)
    reports = agree(world, [small, step, *times], error, failed="--expert-split auto could not time the experts: ")
    small, step, *times = [max(column) for column in zip(*reports)]
    work: Dict[str, Dict[int, float]] = {"whole": {}, "width": {}}
    for (cut, b, _, _), t in zip(runs, times):
        work[cut][b] = t
    one, many = times[-2:]
    probe_bytes = PROBE_EXPERTS * bytes_per_expert([site])[site.layer]
    per_byte_row = max(0.0, many - one) / (ROWS - 1) / probe_bytes
    per_byte = one / probe_bytes
    dense = DenseCost(fixed=max(0.0, per_byte - per_byte_row) * dense_bytes, per_row=per_byte_row * dense_bytes,
                      split=split_share)
    return AutoInputs(link_cost(small, step, world.size, shape), dense, shape), ExpertWork(work)


def _time_probes(site: SwitchSite, runs: List[Tuple[str, int, float, float]], dtype: mx.Dtype,
                 ranks: int) -> List[float]:
    """This rank's fastest seconds of each of ``runs`` (cut, batch, slots,
    distinct experts), then of one row and ``ROWS`` rows per built expert at
    full width (the dense estimate's rates)."""
    probes = {cut: _probe(site, PROBE_EXPERTS, ranks if cut == "width" else 1) for cut in ("whole", "width")}
    full = probes["whole"]
    calls = [_call(probes[cut], slots, distinct, dtype) for cut, _, slots, distinct in runs]
    calls += [_call(full, PROBE_EXPERTS, PROBE_EXPERTS, dtype), _call(full, ROWS * PROBE_EXPERTS, PROBE_EXPERTS, dtype)]
    return [t * scale for t, scale in zip(fastest([c for c, _ in calls]), [s for _, s in calls])]


def dense_linear_bytes(model: nn.Module, sites: List[SwitchSite]) -> Tuple[int, float]:
    """Bytes of the dense linear layers (every ``Linear`` and
    ``QuantizedLinear``: attention, routers, dense and shared MLPs, head; the
    lazy model's sizes, no reads), and the share of them ``shard()`` would
    split: those inside the decoder layers but the MoE blocks' routers."""
    routers = {id(m) for site in sites for m in site.parent.children().values()
               if isinstance(m, (nn.Linear, nn.QuantizedLinear)) and m.weight.shape[0] == site.num_experts}
    total = inside = 0
    for name, module in model.named_modules():
        if not isinstance(module, (nn.Linear, nn.QuantizedLinear)):
            continue
        size = sum(v.nbytes for _, v in tree_flatten(module.parameters()))
        total += size
        if ".layers." in f".{name}" and id(module) not in routers:
            inside += size
    return total, inside / total if total else 0.0


def _probe(site: SwitchSite, experts: int, ranks: int) -> Dict[str, nn.Module]:
    """The site's projections (name -> a module of the same class), each
    holding ``experts`` experts of zeros, 1/``ranks`` of the hidden units."""
    out = {}
    for name, proj in projections(site.module).items():
        probe = type(proj).__new__(type(proj))
        nn.Module.__init__(probe)
        for key, value in vars(proj).items():  # group_size, bits, mode, ...: what __call__ reads
            object.__setattr__(probe, key, value)
        for key, value in tree_flatten(proj.parameters()):
            shape = [experts, *value.shape[1:]]
            axis = hidden_axis(name, key)
            if axis is not None:
                shape[axis] //= ranks
            probe[key] = mx.zeros(shape, dtype=value.dtype)
        mx.eval(probe.parameters())
        out[name] = probe
    return out


def _call(probe: Dict[str, nn.Module], slots: float, distinct: float, dtype: mx.Dtype):
    """A timed step of ``slots`` slots over ``distinct`` experts (at most
    ``PROBE_EXPERTS`` built, scaled by the rest), and its scale."""
    built = max(1, min(PROBE_EXPERTS, round(distinct)))
    scale = max(distinct, 1.0) / built
    count = max(built, round(slots / scale))
    indices = mx.array(np.sort(np.arange(count) % built).reshape(count, 1).astype(np.uint32))
    into = [p for n, p in probe.items() if n not in FROM_HIDDEN]
    back = [p for n, p in probe.items() if n in FROM_HIDDEN]
    x = mx.zeros((count, 1, 1, into[0].input_dims), dtype=dtype)
    mx.eval(indices, x)

    def run():
        hidden = [p(x, indices, sorted_indices=True) for p in into]
        h = hidden[0] if len(hidden) == 1 else nn.silu(hidden[0]) * hidden[1]
        mx.eval([p(h, indices, sorted_indices=True) for p in back])

    return run, scale
