"""Speculative decoding in the benchmark: rows beside plain decoding of the
same mode, in the same launch, one prompt (b = 1; speculation is for one
sequence).

    mpirun -np 2 python -m mlxdist.bench -b 1 --mode collective --prompt-kind repetitive \\
        --prompt-lookup-ngram 2 --num-draft-tokens 4 --draft-model self
    python -m mlxdist.bench compare --link 10gbe --ranks 2 -b 1 --mlxdist-only ...   (the same options)

After a mode's plain rows, one row per drafter asked: prompt lookup
(``--prompt-lookup-ngram N``, a generation parameter: same load) and a draft
model (``--draft-model PATH``, or ``self``: the benchmarked checkpoint as its
own draft, which agrees with it by construction; the mode is loaded again
with it). Each row is a warm-up and ``-n`` greedy trials of the b = 1
prompt, EOS ignored, so every trial makes ``-g`` tokens, and reports

    acceptance          drafted tokens kept / drafted (``DraftTally``)
    tokens_per_forward  tokens made / verifying forwards of the model
    forward_ms          decode time per forward (1e3 x tokens per forward / tok/s):
                        plain decoding's step, or a draft-and-verify cycle
    vs_plain            tok/s over the plain b = 1 row of the mode, same launch
    tokens_equal_plain  every trial's tokens equal the plain row's (greedy)
"""

import argparse
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Union

from mlxdist.config import AUTO_WIDTH, MAX_DRAFT_TOKENS
from mlxdist.inputs.digits import arg_int, arg_int_or

PROMPT_KINDS = ("random", "repetitive")
SELF = "self"  # --draft-model self: the benchmarked checkpoint drafts for itself


@dataclass(frozen=True)
class Drafter:
    """One speculative row's drafter: prompt lookup (``ngram``) or a draft
    model (``model``), drafting ``width`` tokens a forward (or "auto")."""

    label: str
    width: Union[int, str]
    ngram: int = 0
    model: Optional[str] = None


def draft_widths(text: str) -> List[Union[int, str]]:
    """``--num-draft-tokens``: widths (1 to ``MAX_DRAFT_TOKENS``, or auto), comma-separated; argparse's type."""
    read = arg_int_or(AUTO_WIDTH, 1)
    widths = [read(part.strip()) for part in text.split(",")]
    if any(w != AUTO_WIDTH and w > MAX_DRAFT_TOKENS for w in widths) or len(set(widths)) != len(widths):
        raise argparse.ArgumentTypeError(f"widths are from 1 to {MAX_DRAFT_TOKENS} or auto, each once")
    return widths


def add_arguments(parser) -> None:
    """The benchmark's speculative options (``harness`` and ``compare`` pass them through)."""
    parser.add_argument("--prompt-lookup-ngram", type=arg_int(), default=0, metavar="N",
                        help="Also run speculative decoding by prompt lookup on the last N tokens (b = 1 rows).")
    parser.add_argument("--draft-model", default=None, metavar="PATH|self",
                        help="Also run speculative decoding with this draft model (self: the benchmarked "
                             "checkpoint, which agrees with itself by construction); b = 1 rows.")
    parser.add_argument("--num-draft-tokens", type=draft_widths, default=[3], metavar="K|auto[,...]",
                        help="Tokens drafted per verifying forward, or auto: each generation the width chosen "
                             "from the earlier ones' (two whole warm-up generations measure two widths first); "
                             "several, comma-separated: a row for each (default 3).")
    parser.add_argument("--prompt-kind", choices=PROMPT_KINDS, default="random",
                        help="random token ids (as mlx_lm.benchmark), or repetitive: one random token "
                             "repeated, a prompt prompt lookup can draft from (a random-weight model tends to "
                             "continue it in short loops).")


def drafters(args) -> List[Drafter]:
    """The drafters asked for, in the order their rows run."""
    out = []
    if args.prompt_lookup_ngram:
        n = args.prompt_lookup_ngram
        out += [Drafter(f"lookup n={n} k={k}", k, ngram=n) for k in args.num_draft_tokens]
    if args.draft_model:
        name = "self" if args.draft_model == SELF else args.draft_model.rstrip("/").rsplit("/", 1)[-1]
        out += [Drafter(f"draft {name} k={k}", k, model=args.draft_model) for k in args.num_draft_tokens]
    return out


def check_arguments(args, error) -> None:
    """Refuse settings under which the speculative rows cannot run (``error``: argparse's)."""
    if not drafters(args):
        return
    if 1 not in args.batch_sizes:
        error("speculative rows run at b = 1: give -b with 1")
    if not 0 <= args.prompt_lookup_ngram <= 64:
        error("--prompt-lookup-ngram must be from 0 to 64")
    if getattr(args, "no_link", False):
        error("--no-link's tokens are not the model's: no speculative rows with it")


def rows(cluster, mode: str, prompt: List[int], plain: Dict[str, Any], args, generate: Callable,
         load: Callable) -> List[Dict[str, Any]]:
    """A row per drafter for one loaded mode. ``plain``: that mode's b = 1
    row (with its ``tokens``); ``generate(cluster, prompts, max_tokens,
    **sampling)``: one generation's numbers and tokens (the harness's);
    ``load(draft_model=...)``: the mode loaded again with a draft model."""
    out = []
    loaded_draft = False
    for drafter in drafters(args):
        if drafter.model is not None and not loaded_draft:  # once, for each width of the draft model
            load(draft_model=args.model if drafter.model == SELF else drafter.model)
            loaded_draft = True
        sampling = {"num_draft_tokens": drafter.width, "prompt_lookup_ngram": drafter.ngram}
        if drafter.width == AUTO_WIDTH:  # its first two generations measure two widths, the trials run its choice
            for _ in range(2):
                generate(cluster, [prompt], args.generation_tokens, **sampling)
        else:
            generate(cluster, [prompt], min(args.generation_tokens, args.warmup_tokens), **sampling)
        trials = [generate(cluster, [prompt], args.generation_tokens, **sampling) for _ in range(args.num_trials)]
        row = summary(trials, plain)
        row.update(mode=mode, dispatch=mode, mode_in_use=cluster.engine.mode_in_use, strategy=cluster.engine.mode_in_use, batch=1, ranks=cluster.world.size,
                   speculative=drafter.label, num_draft_tokens=drafter.width)
        out.append(row)
    return out


def summary(trials: List[Dict[str, Any]], plain: Dict[str, Any]) -> Dict[str, Any]:
    """One row from a drafter's trials: medians of the numbers (peak memory:
    each rank's largest), whether every trial's tokens equal ``plain``'s, and
    the ratios to it."""
    def median(key):
        return statistics.median(t[key] for t in trials)

    tps, per_forward = median("generation_tps"), median("tokens_per_forward")
    accepted = [t["acceptance"] for t in trials if t["acceptance"] is not None]
    return {
        "prompt_tps": median("prompt_tps"),
        "generation_tps": tps,
        "trials_generation_tps": [t["generation_tps"] for t in trials],
        "generation_tokens": median("generation_tokens"),
        "peak_memory_gb": [max(p) for p in zip(*(t["peak_memory_gb"] for t in trials))],
        "draft_tokens": median("draft_tokens"),
        "draft_tokens_accepted": median("draft_tokens_accepted"),
        "acceptance": statistics.median(accepted) if accepted else None,
        "tokens_per_forward": per_forward,
        "tokens_equal_plain": all(t["tokens"] == plain["tokens"] for t in trials),
        "trials_num_draft_tokens": [t["num_draft_tokens"] for t in trials],  # the width each trial drafted
        "forward_ms": 1e3 * per_forward / tps,
        "plain_forward_ms": 1e3 / plain["generation_tps"],
        "vs_plain": tps / plain["generation_tps"],
    }


def format_rows(rows_: List[Dict[str, Any]]) -> str:
    """The harness's table of speculative rows ('' without any)."""
    spec = [r for r in rows_ if r.get("speculative")]
    if not spec:
        return ""
    lines = ["", "", "speculative, b = 1 (plain: the mode's b = 1 row above, same prompt and launch)",
             "dispatch    drafter               gen t/s  x plain  acceptance  tok/forward  forward ms (plain)  "
             "tokens = plain"]
    for r in spec:
        lines.append(f"{r['dispatch']:<10}  {r['speculative']:<20}  {r['generation_tps']:>7.1f}  {r['vs_plain']:>7.2f}  "
                     f"{_pct(r['acceptance']):>10}  {r['tokens_per_forward']:>11.2f}  "
                     f"{r['forward_ms']:>7.1f} ({r['plain_forward_ms']:.1f})  {'yes' if r['tokens_equal_plain'] else 'NO'}")
    return "\n".join(lines)


def _pct(value: Optional[float]) -> str:
    return "-" if value is None else f"{100 * value:.0f} %"


def markdown(result: Dict[str, Any]) -> List[str]:
    """Markdown lines for ``compare``'s report: the speculative rows beside
    their plain rows ([] without any). A row's speed-up is its tokens per
    forward over what a forward (draft and verify) costs in plain steps."""
    spec = [r for r in result["results"] if r.get("speculative")]
    if not spec:
        return []
    lines = ["", f"Speculative decoding, b = 1, greedy ({result.get('prompt_kind', 'random')} prompt): each row "
                 "ran in the same launches as its mode's plain row, on the same prompt:", "",
             "| N | contender | gen tok/s | × plain | acceptance (kept / drafted) | tokens / forward | "
             "ms / forward (plain) | forward / plain step | tokens = plain |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in spec:
        rounds = r.get("vs_plain_rounds") or []
        ratio = "—" if r.get("vs_plain") is None else f"{r['vs_plain']:.2f}" + (
            f" ({min(rounds):.2f}-{max(rounds):.2f})" if len(rounds) > 1 else "")
        widths = r.get("trials_num_draft_tokens") if r.get("num_draft_tokens") == AUTO_WIDTH else None
        contender = r["contender"] + (f" (drafted {', '.join(map(str, widths))})" if widths else "")
        lines.append(f"| {r['ranks']} | {contender} | {r['generation_tps']:.1f} | {ratio} | "
                     f"{_pct(r['acceptance'])} ({r['draft_tokens_accepted']:.0f} / {r['draft_tokens']:.0f}) | "
                     f"{r['tokens_per_forward']:.2f} | {r['forward_ms']:.1f} ({r['plain_forward_ms']:.1f}) | "
                     f"{r['forward_ms'] / r['plain_forward_ms']:.2f} | "
                     f"{'yes' if r['tokens_equal_plain'] else '**no**'} |")
    lines += ["", "*ms / forward*: decode time per verifying forward of the model (the drafting included), "
                  "1e3 × tokens per forward / tok/s; plain decoding's is its step. × plain ≈ tokens per forward / "
                  "(forward / plain step)."]
    return lines
