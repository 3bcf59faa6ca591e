"""``python -m mlxdist.synth OUT_DIR [--preset ...]``: write a synthetic
checkpoint, or a draft cut from one (``--draft-of``)."""

import argparse
import json
import math

from mlxdist.inputs.digits import arg_int, arg_number
from mlxdist.synth.checkpoint import write_checkpoint, write_draft
from mlxdist.synth.presets import PRESETS, TINY_MODELS, TINY_PREFIX
from mlxdist.synth.weights import SKEW_ORDERS


def main() -> None:
    """The command line: the arguments from ``sys.argv``."""
    parser = argparse.ArgumentParser(
        prog="python -m mlxdist.synth",
        description="Write a random-weight MoE checkpoint in mlx-lm's layout or the model's hub layout."
    )
    parser.add_argument("out_dir", help="Output directory.")
    presets = sorted(PRESETS) + [TINY_PREFIX + t for t in TINY_MODELS]
    parser.add_argument("--preset", default="qwen3_moe", choices=presets)
    parser.add_argument("--bits", type=arg_int(), default=None, help="Quantize to N bits.")
    parser.add_argument("--group-size", type=arg_int(), default=64)
    parser.add_argument("--layers", type=arg_int(), default=None, help="Number of layers.")
    parser.add_argument("--seed", type=arg_int(), default=0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--skew", type=arg_number(), default=0.0,
                        help="Favour some experts in routing (models with a router bias: gpt_oss, deepseek_v3).")
    parser.add_argument("--skew-order", default="random", choices=SKEW_ORDERS,
                        help="Which experts --skew favours: a random order per layer, or clustered (expert 0 most, "
                             "so even blocks of experts put the hot ones on one rank).")
    parser.add_argument("--layout", default="mlx", choices=["mlx", "hub"],
                        help="mlx-lm's layout, or the one the model's authors ship (per-expert tensors; "
                             "gpt_oss: fused mxfp4 experts).")
    parser.add_argument("--mxfp4-experts", action="store_true",
                        help="Quantize the experts alone to mxfp4 (gpt-oss's form; implied by --layout hub there).")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="Override a config value (JSON), e.g. --set num_local_experts=64.")
    parser.add_argument("--residual-scale", type=arg_number(), default=None,
                        help="Scale what each block adds to the residual stream: well under 1 (0.01), the next token "
                             "hangs on the current one's embedding, and a --draft-of cut agrees with the model "
                             "(default 1; 0.01 with --tool-call).")
    parser.add_argument("--tool-call", action="store_true",
                        help="A model that calls a tool: Qwen3's tool-call tokens and chat template, and greedy "
                             "decoding after a prompt offering get_weather answers <tool_call>{\"name\":"
                             "\"get_weather\",\"arguments\":{\"city\":\"Paris\"}}</tool_call> (checked with "
                             "mlx-lm once written).")
    parser.add_argument("--draft-of", metavar="TARGET",
                        help="Write a speculative-decoding draft cut from the checkpoint TARGET instead: its first "
                             "--layers layers (default 1), embedding, norm, head and tokenizer.")
    args = parser.parse_args()
    if args.residual_scale is not None and not math.isfinite(args.residual_scale):
        parser.error(f"--residual-scale must be a finite number, not {args.residual_scale}")
    if args.draft_of:
        layers = 1 if args.layers is None else args.layers
        try:
            path = write_draft(args.out_dir, args.draft_of, layers)
        except (OSError, ValueError, KeyError) as e:  # no such checkpoint, a config without layers, a bad count
            parser.error(f"cannot cut a draft from {args.draft_of}: {e}")
        print(f"Wrote a {layers}-layer draft of {args.draft_of} to {path}")
        return

    overrides = {}
    if args.layers is not None:
        overrides["num_hidden_layers"] = args.layers
    for item in args.set:
        key, _, value = item.partition("=")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    try:
        path = write_checkpoint(
            args.out_dir,
            args.preset,
            quantize_bits=args.bits,
            group_size=args.group_size,
            seed=args.seed,
            overrides=overrides,
            dtype=args.dtype,
            router_skew=args.skew,
            skew_order=args.skew_order,
            layout=args.layout,
            mxfp4_experts=args.mxfp4_experts,
            residual_scale=args.residual_scale,
            tool_call=args.tool_call,
        )
    except ValueError as e:  # a preset, layout or option this writer cannot honour
        parser.error(str(e))
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    print(f"Wrote {args.preset} to {path} ({size / 2**20:.1f} MiB of weights)")
