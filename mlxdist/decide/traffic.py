"""What each mode puts on the wire per decode step: the input of the
benchmark's link model (``bench/links.py``) and of its transport floor.

Per MoE layer (b tokens in the step, N ranks, width D, top-k K, s bytes per
activation value), each mode runs these collectives; a rank's bytes on
the wire follow the ring algorithms (all_sum of S bytes: 2(N-1)/N x S in
2(N-1) hops; all_gather of S per rank: (N-1) x S in N-1 hops):

    collective  all_sum of every slot           [b, K, D]
    dp          all_gather of own rows          [b/N, D] + K weights and ids (4 bytes each)
                all_sum of the partial sums     [b, D]     (NCCL: a reduce-scatter, half of it)
    dp-width    (experts cut in width: whole blocks) all_gather [b/N, D], all_sum [b, D]
    collective-width  all_sum of the block's partial output [b, D]
    p2p         rank 0 sends each token once to each rank it needs, gets one row per slot back
    tensor      mlx-lm's shard(): two all_sums  [b, D] in every layer (attention and MLP/MoE)
    replicas    nothing

``tensor`` (mlx-lm's contender in the benchmark) and ``replicas`` (mlxdist's mode, and the wire of mlx-lm's instances), not
dispatch modes; they are modelled here beside the modes to be compared.
"""

from dataclasses import dataclass
from typing import Dict, List, Tuple


@dataclass(frozen=True)
class Shape:
    hidden: int  # D
    top_k: int  # K
    layers: int  # decoder layers
    moe_layers: int
    itemsize: int  # bytes per activation value


# Modes whose rows change with --expert-split width (named "<mode>-width").
WIDTH_MODES = ("dp", "collective", "collective-tp")


def collectives(mode: str, n: int, b: int, shape: Shape) -> Tuple[List[Tuple[float, int]], int]:
    """([(bytes a rank sends, hops)] per exchanging layer, exchanging layers)
    for one decode step of ``b`` tokens."""
    d, k, s = shape.hidden, shape.top_k, shape.itemsize
    ring_sum = lambda size: (2 * (n - 1) / n * size, 2 * (n - 1))  # noqa: E731
    if mode == "collective":
        return [ring_sum(b * k * d * s)], shape.moe_layers
    if mode == "collective-width":
        return [ring_sum(b * d * s)], shape.moe_layers
    if mode == "dp-width":
        return [((n - 1) * b / n * d * s, n - 1), ring_sum(b * d * s)], shape.moe_layers
    if mode == "dp":
        gather = ((n - 1) * b / n * (d * s + k * (s + 4)), n - 1)  # x, K weights (the block's dtype), K ids
        return [gather, ring_sum(b * d * s)], shape.moe_layers
    if mode == "p2p":  # rank 0's side, uniform routing: each token reaches ~min(K, N-1) workers
        out = b * min(k, n - 1) * (n - 1) / n * d * s + b * k * 8
        back = b * k * (n - 1) / n * d * s
        return [(out + back, 2)], shape.moe_layers
    # collective-tp: attention's all_sum, and the MoE block's own of its weighted sum, every layer
    if mode in ("tensor", "collective-tp", "collective-tp-width"):
        return [ring_sum(b * d * s), ring_sum(b * d * s)], shape.layers
    return [], 0


def traffic(mode: str, n: int, b: int, shape: Shape) -> Dict[str, float]:
    """Bytes a rank sends and collectives it joins, per token per layer."""
    ops, layers = collectives(mode, n, b, shape)
    per_layer = sum(size for size, _ in ops)
    return {"bytes_per_token_layer": per_layer / b if ops else 0.0, "collectives_per_layer": len(ops),
            "exchanging_layers": layers}


def wire_name(mode: str, expert_split: str) -> str:
    """The mode as the traffic model names it: ``<mode>-width`` where
    experts cut in width change its rows."""
    return f"{mode}-width" if expert_split == "width" and mode in WIDTH_MODES else mode


def exchange_kind(name: str) -> str:
    """The bare exchange one decode-step layer of ``name`` (a ``wire_name``)
    runs: "sendrecv" (sends and receives), "gather" (all_gather of rows with their
    routing, then a reduce), "gather-rows" (the same without routing) or
    "sum" (one all_sum)."""
    return {"p2p": "sendrecv", "dp": "gather", "dp-width": "gather-rows"}.get(name, "sum")


def floor_shape(name: str, slots_shape: List[int]) -> List[int]:
    """The array one decode-step layer of ``name`` exchanges, from the
    shape of its slots [.., K, D]: collective-tp's MoE block sums its
    weighted [.., D] output, not the slots."""
    return slots_shape[:-2] + slots_shape[-1:] if name == "collective-tp" else slots_shape
