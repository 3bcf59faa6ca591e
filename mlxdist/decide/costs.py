"""What a decode step costs on this cluster, measured once at load for
``auto`` (``decide/linkcost.py`` chooses from it).

    link   the ranks time MLX ``all_sum``s on the dispatch's group and on
           mlx-lm's generation stream, as a decode step runs them: ``CHAIN``
           in one graph, each on the previous one's result after an
           elementwise op (a layer's work between two exchanges, and the
           hand-off to the device and back that it costs where there is
           one), of a row [1, D] and of a step's slots [rows, K, D] of at
           least 256 KiB, in the activations' dtype, taken in turns (a few
           milliseconds on a fast link);
    dense  each rank times the model's dense linear layers (every
           ``Linear`` and ``QuantizedLinear`` outside the experts: attention,
           router, shared experts, head) on 1 and on ``ROWS`` rows; an
           expert slot is one expert's bytes at that rate on one row.

Each rank keeps its fastest round of each: a link's own cost is its best
round, and ranks sharing cores only add to it. The ranks then agree on the
largest figure of any rank (``agree``), so every rank chooses from the
same numbers; a rank whose timing of the dense layers fails still joins the
agreement, and every rank raises its one line.
"""

import time
from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.generate import generation_stream

from mlxdist.decide import traffic
from mlxdist.decide.linkcost import AutoInputs, DenseCost, LinkCost, row_bytes
from mlxdist.errors import one_line
from mlxdist.model.checkpoint import hidden_size
from mlxdist.runtime import faults
from mlxdist.runtime.agreement import agree
from mlxdist.runtime.world import World

__all__ = ["fastest", "link_cost", "link_rounds", "measure_auto_inputs", "model_shape", "split_bytes"]

STEP_BYTES = 1 << 18  # the step-sized all_sum holds at least this much, for its bytes to show over the latency
CHAIN = 4  # all_sums per timed round
ROUNDS = 5  # timed rounds of each figure, after one more to warm up
ROWS = 8  # rows of the second dense timing


def model_shape(model: nn.Module, config: Dict, moe_layers: int, top_k: int, dtype: mx.Dtype) -> traffic.Shape:
    """The shapes the traffic model needs (``traffic.Shape``)."""
    layers = len(getattr(model, "layers", None) or []) or moe_layers
    return traffic.Shape(hidden=hidden_size(config, model), top_k=top_k, layers=layers, moe_layers=moe_layers,
                         itemsize=dtype.size)


def measure_auto_inputs(world: World, model: nn.Module, shape: traffic.Shape, dtype: mx.Dtype,
                        split: int = 0, link: Optional[LinkCost] = None, expert_bytes: float = 0.0) -> AutoInputs:
    """The link and the dense work, measured on every rank and agreed.
    Every rank calls it at the same point. ``split``: the bytes of the dense
    layers that collective-tp's ``shard()`` divides (``split_bytes``);
    ``link``: the link as this load measured it already (``--expert-split
    auto`` does, before the experts are read), or None to measure it here;
    ``expert_bytes``: one routed expert's weights, read for a slot at the
    dense layers' rate on one row."""
    small, step = link_rounds(world, shape, dtype) if link is None else (0.0, 0.0)
    (one, many), linear_bytes, error = (0.0, 0.0), 0, None
    try:
        faults.point("load", world.rank, op="measure")
        (one, many), linear_bytes = _dense_rounds(model, dtype)
    except Exception as e:  # noqa: BLE001 - anything mlx raises: reported by every rank below
        error = one_line(e)
    reports = agree(world, [small, step, one, many], error, failed="auto could not time the dense layers: ")
    small, step, one, many = [max(column) for column in zip(*reports)]
    link = link_cost(small, step, world.size, shape) if link is None else link
    per_row = max(0.0, many - one) / (ROWS - 1)
    share = min(1.0, split / linear_bytes) if linear_bytes else 0.0
    expert_slot = one / linear_bytes * expert_bytes if linear_bytes else 0.0
    return AutoInputs(link, DenseCost(fixed=max(0.0, one - per_row), per_row=per_row, split=share), shape, expert_slot)


def link_cost(small: float, step: float, ranks: int, shape: traffic.Shape) -> LinkCost:
    """The link from ``link_rounds``' two figures (agreed): the row's time is
    the latency, the step's extra bytes (traffic.py's wire count) the rest."""
    beyond_row = (_step_rows(shape) * shape.top_k - 1) * row_bytes(ranks, shape)
    return LinkCost(latency=small, seconds_per_byte=max(0.0, step - small) / beyond_row)


def _step_rows(shape: traffic.Shape) -> int:
    """Rows of the step-sized all_sum: [rows, K, D] of at least STEP_BYTES."""
    return -(-STEP_BYTES // (shape.top_k * shape.hidden * shape.itemsize))


def link_rounds(world: World, shape: traffic.Shape, dtype: mx.Dtype) -> Tuple[float, float]:
    """This rank's fastest all_sum of a row [1, D] and of a step's slots [rows, K, D], in seconds."""
    row = mx.zeros((1, shape.hidden), dtype=dtype)
    slots = mx.zeros((_step_rows(shape), shape.top_k, shape.hidden), dtype=dtype)
    mx.eval(row, slots)

    def chain(x: mx.array) -> Callable[[], None]:
        def run():
            y = x
            for _ in range(CHAIN):
                y = mx.distributed.all_sum(y, group=world.group) + 1
            mx.eval(y)

        return run

    with mx.stream(generation_stream):
        small, step = fastest([chain(row), chain(slots)])
    mx.synchronize(generation_stream)  # before the control plane speaks (MPI: one thread at a time)
    return small / CHAIN, step / CHAIN


def _dense_rounds(model: nn.Module, dtype: mx.Dtype) -> Tuple[Tuple[float, float], int]:
    """This rank's fastest pass over the dense linear layers on 1 and on
    ``ROWS`` rows, in seconds, and those layers' bytes."""
    linears = _dense_linears(model)
    inputs: Dict[int, Dict[int, mx.array]] = {}
    for rows in (1, ROWS):  # [rows, in] zeros per input width
        inputs[rows] = {d: mx.zeros((rows, d), dtype=dtype) for d in {_input_dims(m) for m in linears}}
        mx.eval(list(inputs[rows].values()))

    def apply(rows: int) -> Callable[[], None]:
        return lambda: mx.eval([m(inputs[rows][_input_dims(m)]) for m in linears])

    times = fastest([apply(1), apply(ROWS)]) if linears else (0.0, 0.0)
    return times, sum(v.nbytes for m in linears for _, v in tree_flatten(m.parameters()))


def fastest(steps: List[Callable[[], None]]) -> Tuple[float, ...]:
    """Each step's fastest of ``ROUNDS`` timed rounds, the steps taken in turns."""
    best = [float("inf")] * len(steps)
    for round_ in range(1 + ROUNDS):
        for i, step in enumerate(steps):
            tic = time.perf_counter()
            step()
            if round_:
                best[i] = min(best[i], time.perf_counter() - tic)
    return tuple(best)


def _dense_linears(model: nn.Module) -> List[nn.Module]:
    """Every distinct ``Linear`` and ``QuantizedLinear`` of the model (the
    experts are switch layers of their own kind, not among them)."""
    seen: Dict[int, nn.Module] = {}
    for _, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.QuantizedLinear)):
            seen.setdefault(id(module), module)
    return list(seen.values())


def _input_dims(module: nn.Module) -> int:
    if isinstance(module, nn.QuantizedLinear):
        return module.scales.shape[-1] * module.group_size
    return module.weight.shape[-1]


def split_bytes(twin: Optional[nn.Module], model: nn.Module, ranks: int) -> int:
    """Bytes of ``model``'s dense layers that the twin splits over ``ranks``
    (the twin holds 1/N of each as its own arrays); 0 without a twin."""
    if twin is None:
        return 0
    from mlxdist.model.tensor_parallel import own_bytes

    return own_bytes(twin, model) * ranks
