"""How close the data-parallel mode is to one GPU on a real-size checkpoint.

    mpirun -np 2 benchmarks/gpu/rank.sh python tests/scripts/batch_each.py dp masked 16,16,16,16 0 2048 MODEL > dp.json
    python benchmarks/gpu/dp_close.py MODEL dp.json [GROUPS]

Runs mlx-lm's batch_generate on the same prompts in this process (one GPU) and
prints, as JSON, the first step where each sequence's tokens differ and the
largest |difference| of the sampled tokens' log-probabilities before it.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "scripts"))

from batch_each import PROMPTS  # noqa: E402


def main(model: str, report: str, groups: int = 1) -> None:
    """``groups`` > 1: the reference runs each rank's sequences (i % groups)
    as its own batch, so only the exchange differs, not the batches' shapes."""
    from mlx_lm import load
    from mlx_lm.generate import batch_generate

    got = json.loads([l for l in Path(report).read_text().splitlines() if l.startswith("{")][-1])[model]
    n = len(got["tokens"])
    lm, tokenizer = load(model)
    ids = [tokenizer.encode(p) for p in PROMPTS[:n]]
    ref_tokens, ref_logprobs = [None] * n, [None] * n
    for g in range(groups):
        members = list(range(g, n, groups))
        ref = batch_generate(lm, tokenizer, [ids[i] for i in members], max_tokens=[len(got["tokens"][i]) for i in members],
                             return_token_ids=True, return_logprobs=True)
        for i, t, lp in zip(members, ref.token_ids, ref.logprobs):
            ref_tokens[i], ref_logprobs[i] = t, lp
    rows = []
    for g, r, gl, rl in zip(got["tokens"], ref_tokens, got["logprobs"], ref_logprobs):
        first = next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), None)
        upto = len(g) if first is None else first
        rows.append({"equal_tokens": upto, "of": len(g), "max_logprob_diff": max(abs(a - b) for a, b in zip(gl[:upto], rl[:upto])) if upto else None})
    print(json.dumps({"model": model, "strategy": got["strategy"], "groups": groups, "sequences": rows}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 1)
