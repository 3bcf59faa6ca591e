"""``python -m mlxdist.bench project``: decode tok/s of large MoE models on
two and four Macs, projected from their shapes, a chip's memory bandwidth and
what a collective costs over the link. A model, not a measurement: every
input is printed with the table.

At one sequence a decode step reads the weights it uses once (it is bound by
memory bandwidth) and pays each collective it runs. Per rank and token:

    step = bytes read by the busiest rank / (bandwidth x efficiency)
           + collectives per token x cost of one collective

what each contender reads and runs (L layers, M of them MoE, K experts a
token, N machines; "dense": attention, shared experts, dense layers' MLPs,
routers and the output head; one expert's weights "e"):

    one machine      dense + M K e                                   no collective
    mlxdist collective   dense + M E[max experts on one rank] e     M all_sums
    mlxdist collective-tp  dense / N + head + M E[max] e             L + M all_sums
    mlxdist collective-tp, experts cut in width (where N divides the experts' quantization
                     groups: --expert-split auto's other cut): what tensor parallelism reads and runs
    tensor parallel (mlx-lm shard(), exo)  (dense - head) / N + head + M K e / N   2 L all_sums
    pipeline         (dense + M K e) / N on each of N machines in turn   N - 1 hops

E[max] is the expected largest number of a token's K distinct experts that
fall on one of N ranks holding E / N experts each (uniform routing, exact).
Bits a weight: 4.5 for mlx-lm's 4-bit quantization (group 64, a bf16 scale
and bias each), 4.25 for MXFP4 (gpt-oss), 8.5 for 8-bit.
"""

import argparse
import math
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Dict, List, Optional

from mlxdist.inputs.digits import arg_number

__all__ = ["MODELS", "ModelShape", "expected_busiest", "project", "main"]


@dataclass(frozen=True)
class ModelShape:
    """What a decode step reads, in parameters (from the model's config.json)."""

    name: str
    layers: int
    moe_layers: int
    hidden: int
    experts: int
    top_k: int
    expert_params: int  # one routed expert's weights
    attention_params: int  # per layer
    shared_params: int  # per MoE layer: shared experts and router
    dense_mlp_params: int  # per dense (non-MoE) layer
    head_params: int  # output head (vocab x hidden)
    bits: float  # bits per weight with quantization scales
    source: str
    width_groups: int = 0  # quantization groups across an expert's hidden units: a cut in width needs N to divide them

    @property
    def dense_params(self) -> int:
        return (self.layers * self.attention_params + self.moe_layers * self.shared_params
                + (self.layers - self.moe_layers) * self.dense_mlp_params + self.head_params)

    def gb(self, params: float) -> float:
        return params * self.bits / 8 / 1e9


def _mla(hidden: int, heads: int, q_rank: int = 1536, kv_rank: int = 512, nope: int = 128, rope: int = 64,
         v_head: int = 128) -> int:
    """DeepSeek-V3's multi-head latent attention, one layer."""
    return (hidden * q_rank + q_rank * heads * (nope + rope) + hidden * (kv_rank + rope)
            + kv_rank * heads * (nope + v_head) + heads * v_head * hidden)


def _gqa(hidden: int, heads: int, kv_heads: int, head_dim: int) -> int:
    return hidden * head_dim * (2 * heads + 2 * kv_heads)


MODELS: Dict[str, ModelShape] = {m.name: m for m in (
    ModelShape("DeepSeek-V3", 61, 58, 7168, 256, 8, 3 * 7168 * 2048, _mla(7168, 128),
               3 * 7168 * 2048 + 256 * 7168, 3 * 7168 * 18432, 129280 * 7168, 4.5,
               "deepseek-ai/DeepSeek-V3 config.json: 61 layers (3 dense), 256 routed experts of 2048 + 1 shared, "
               "top-8, MLA with 128 heads, vocabulary 129,280", 2048 // 64),
    ModelShape("Kimi K2", 61, 60, 7168, 384, 8, 3 * 7168 * 2048, _mla(7168, 64),
               3 * 7168 * 2048 + 384 * 7168, 3 * 7168 * 18432, 163840 * 7168, 4.5,
               "moonshotai/Kimi-K2-Instruct config.json: DeepSeek-V3's layout, 61 layers (1 dense), 384 experts, "
               "top-8, 64 heads, vocabulary 163,840", 2048 // 64),
    ModelShape("Qwen3-235B-A22B", 94, 94, 4096, 128, 8, 3 * 4096 * 1536, _gqa(4096, 64, 4, 128),
               128 * 4096, 0, 151936 * 4096, 4.5,
               "Qwen/Qwen3-235B-A22B config.json: 94 layers, 128 experts of 1536, top-8, 64 query / 4 KV heads "
               "of 128, vocabulary 151,936", 1536 // 64),
    ModelShape("gpt-oss-120b", 36, 36, 2880, 128, 4, 3 * 2880 * 2880, _gqa(2880, 64, 8, 64),
               128 * 2880, 0, 201088 * 2880, 4.25,
               "openai/gpt-oss-120b config.json: 36 layers, 128 experts of 2880, top-4, 64 query / 8 KV heads of "
               "64, vocabulary 201,088; experts in MXFP4", 2880 // 32),
)}

# Unified memory bandwidth, Apple's figures (GB/s).
CHIPS = {"m3-ultra": 819.0, "m4-max": 546.0, "m2-ultra": 800.0}

# Published decode tok/s of exo (tensor parallel over RDMA, Thunderbolt 5) on 1 / 2 / 4 M3 Ultras.
EXO = {"DeepSeek-V3": ("DeepSeek V3.1, 8-bit", [21.1, 27.8, 32.5]),
       "Qwen3-235B-A22B": ("Qwen3-235B", [19.5, 26.2, 31.9]),
       "Kimi K2": ("Kimi K2 Thinking", [None, 21.6, 28.3])}


@lru_cache(maxsize=None)
def expected_busiest(experts: int, n: int, k: int) -> float:
    """E[the most of a token's k distinct experts held by one of n ranks of experts / n each]."""
    per = experts // n

    def ways(ranks: int, left: int, cap: int) -> int:  # ways to pick ``left`` experts, at most ``cap`` per rank
        if ranks == 0:
            return 1 if left == 0 else 0
        return sum(math.comb(per, j) * ways(ranks - 1, left - j, cap) for j in range(min(cap, left) + 1))

    total = math.comb(per * n, k)
    at_most = [ways(n, k, cap) / total for cap in range(k + 1)]
    return sum(cap * (at_most[cap] - (at_most[cap - 1] if cap else 0.0)) for cap in range(k + 1))


def project(model: ModelShape, n: int, bandwidth: float, collective_us: float,
            efficiency: float = 1.0) -> Dict[str, Dict[str, float]]:
    """Per contender: GB the busiest machine reads per token, collectives per
    token, and tok/s at batch 1."""
    e = model.gb(model.expert_params)
    dense, head = model.gb(model.dense_params), model.gb(model.head_params)
    routed = model.moe_layers * model.top_k * e
    busiest = model.moe_layers * expected_busiest(model.experts, n, model.top_k) * e
    tensor_parallel = ((dense - head) / n + head + routed / n, 2 * model.layers, 0)
    rows = {
        "one machine": (dense + routed, 0, 0),
        "mlxdist collective": (dense + busiest, model.moe_layers, 0),
        "mlxdist collective-tp": ((dense - head) / n + head + busiest, model.layers + model.moe_layers, 0),
        "mlxdist collective-tp, width": tensor_parallel,  # experts cut as shard() cuts them: the same reads
        "tensor parallel": tensor_parallel,
        "pipeline": (dense + routed, 0, n - 1),  # every machine in turn reads its 1/N
    }
    if model.width_groups % n:  # the experts cannot be cut over n
        del rows["mlxdist collective-tp, width"]
    out = {}
    for name, (gb, collectives, hops) in rows.items():
        seconds = gb / (bandwidth * efficiency) + (collectives + hops) * collective_us * 1e-6
        out[name] = {"gb_per_token": gb, "collectives": collectives + hops, "tps": 1 / seconds}
    return out


def markdown(chip: str, collective_us: float, machines: List[int], efficiency: float,
             bits: Optional[float] = None) -> str:
    bandwidth = CHIPS[chip]
    lines = [f"Chip {chip}: {bandwidth:g} GB/s at {efficiency:.0%} efficiency; one collective (or pipeline hop) "
             f"{collective_us:g} µs; batch 1" + (f"; {bits:g} bits a weight" if bits else "") + ".", ""]
    for model in MODELS.values():
        if bits:
            model = replace(model, bits=bits)
        fits = model.gb(model.dense_params + model.moe_layers * model.experts * model.expert_params)
        lines += [f"### {model.name}", "", f"{model.source}. At {model.bits:g} bits a weight: weights {fits:.0f} GB; dense part "
                  f"{model.gb(model.dense_params):.1f} GB; a token's routed experts "
                  f"{model.gb(model.moe_layers * model.top_k * model.expert_params):.1f} GB.", "",
                  "| machines | contender | GB read, busiest machine | collectives a token | tok/s |",
                  "|---|---|---|---|---|"]
        for n in machines:
            for name, row in project(model, n, bandwidth, collective_us, efficiency).items():
                if name == "one machine" and n != machines[0]:
                    continue
                label = "1" if name == "one machine" else str(n)
                lines.append(f"| {label} | {name} | {row['gb_per_token']:.2f} | {row['collectives']} | {row['tps']:.1f} |")
        if model.name in EXO:
            what, figures = EXO[model.name]
            lines += ["", f"exo, published ({what}, tensor parallel over RDMA, M3 Ultras): "
                      + ", ".join(f"{m} machine{'s' if m > 1 else ''} {t}" for m, t in zip((1, 2, 4), figures) if t)
                      + " tok/s."]
        lines.append("")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mlxdist.bench project", description=__doc__.split("\n")[0])
    parser.add_argument("--chip", choices=tuple(CHIPS), default="m3-ultra")
    parser.add_argument("--collective-us", type=arg_number(), default=150.0,
                        help="What one collective costs over the link, µs (default %(default)s).")
    parser.add_argument("--machines", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4])
    parser.add_argument("--efficiency", type=arg_number(), default=1.0, help="Fraction of the bandwidth reached.")
    parser.add_argument("--bits", type=arg_number(), default=None,
                        help="Bits a weight for every model (default: each model's 4-bit or MXFP4 figure).")
    args = parser.parse_args(argv)
    if not (0 < args.efficiency <= 1 and 0 <= args.collective_us < 1e6 and all(1 < m <= 64 for m in args.machines)
            and (args.bits is None or 1 <= args.bits <= 32)):
        parser.error("--efficiency in (0, 1], --collective-us in [0, 1e6), machines from 2 to 64, --bits 1 to 32")
    print(markdown(args.chip, args.collective_us, args.machines, args.efficiency, args.bits))


if __name__ == "__main__":
    main()
