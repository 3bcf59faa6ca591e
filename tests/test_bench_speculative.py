"""Speculative decoding in the benchmark (bench/speculative.py): its rows
run beside plain decoding in the same launch, report acceptance and tokens
per forward, and carry tokens equal to plain greedy decoding's; compare puts
them beside their plain row with the rounds' ratios."""

import pytest

from conftest import last_json, launch

K = 3
G = 12


@pytest.fixture(scope="module")
def model(checkpoint):
    return checkpoint("qwen3_moe")


def test_speculative_rows_beside_plain(model):
    """Two ranks, collective: plain b = 1, then prompt lookup and the model as
    its own draft (which agrees by construction), on a repetitive prompt,
    each at K and at auto's widths."""
    r = launch(2, ["--model", model, "-p", 16, "-g", G, "-b", 1, "-n", 1, "--warmup-tokens", 2,
                   "--mode", "collective", "--prompt-kind", "repetitive", "--prompt-lookup-ngram", 2,
                   "--num-draft-tokens", f"{K},auto", "--draft-model", "self", "--json"], module="mlxdist.bench",
               timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    report = last_json(r.stdout)
    assert report["prompt_kind"] == "repetitive"
    rows = report["results"]
    assert [(x["dispatch"], x["batch"], x.get("speculative")) for x in rows] == [
        ("collective", 1, None), ("collective", 1, f"lookup n=2 k={K}"), ("collective", 1, "lookup n=2 k=auto"),
        ("collective", 1, f"draft self k={K}"), ("collective", 1, "draft self k=auto")]
    plain, lookup, lookup_auto, draft, draft_auto = rows
    assert "tokens" not in plain  # used for the check, not reported
    for row in (lookup_auto, draft_auto):  # after two warm-ups at 3 and one more or fewer: the fitted width
        assert row["tokens_equal_plain"] is True and row["num_draft_tokens"] == "auto"
        assert len(row["trials_num_draft_tokens"]) == 1 and 1 <= row["trials_num_draft_tokens"][0] <= 16
    for row in (lookup, draft):
        assert row["tokens_equal_plain"] is True
        assert row["generation_tokens"] == G and row["generation_tps"] > 0
        assert 0 < row["draft_tokens"] <= G * K and 0 <= row["draft_tokens_accepted"] <= row["draft_tokens"]
        assert row["acceptance"] == row["draft_tokens_accepted"] / row["draft_tokens"]
        assert 1.0 <= row["tokens_per_forward"] <= K + 1
        assert row["vs_plain"] == pytest.approx(row["generation_tps"] / plain["generation_tps"])
        assert row["forward_ms"] == pytest.approx(1e3 * row["tokens_per_forward"] / row["generation_tps"])
        assert len(row["peak_memory_gb"]) == 2
    # the checkpoint drafting for itself: every draft kept (G = 12 is three forwards of K + 1)
    assert draft["acceptance"] == 1.0 and draft["tokens_per_forward"] == K + 1


def test_speculative_table_and_refusals(model):
    r = launch(0, ["--model", model, "-p", 8, "-g", 4, "-b", 1, "-n", 1, "--warmup-tokens", 1,
                   "--mode", "collective", "--prompt-lookup-ngram", 1], module="mlxdist.bench")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    head = next(i for i, l in enumerate(lines) if l.startswith("speculative, b = 1"))
    assert "acceptance" in lines[head + 1] and "tokens = plain" in lines[head + 1]
    assert lines[head + 2].split()[:4] == ["collective", "lookup", "n=1", "k=3"]
    assert lines[head + 2].split()[-1] == "yes"
    refused = launch(0, ["--model", model, "-b", "8", "--prompt-lookup-ngram", 2], module="mlxdist.bench")
    assert refused.returncode != 0 and "speculative rows run at b = 1" in refused.stderr


def test_draft_tally_counts_forwards_and_drafts():
    """mlx-lm's loop: each forward drafts min(k, tokens left), yields the kept
    drafts, then the model's own token unless the generation is full."""
    from mlxdist.engine.speculative import DraftTally

    tally = DraftTally(num_draft_tokens=3, max_tokens=9)
    for from_draft in (True, False,  # forward 1: 1 of 3 kept
                       True, True, True, False,  # forward 2: all 3 kept, then the model's token
                       True, True, True):  # forward 3: min(3, 3 left), all kept, the generation full
        tally.add(from_draft)
    assert tally.stats() == {"draft_tokens": 9, "draft_tokens_accepted": 7, "acceptance": 7 / 9,
                             "tokens_per_forward": 3.0, "num_draft_tokens": 3}
    assert tally.rejected == 1  # forward 1 ended at a rejected draft (verify_width.py's estimate counts it)
    plain = DraftTally(num_draft_tokens=0, max_tokens=4)
    for _ in range(4):
        plain.add(False)
    assert plain.stats() == {"draft_tokens": 0, "draft_tokens_accepted": 0, "acceptance": None,
                             "tokens_per_forward": 1.0, "num_draft_tokens": 0}
    assert plain.rejected == 0


def test_compare_puts_speculative_rows_beside_plain():
    """compare's aggregation: the ratio to plain is the median of the rounds'
    ratios, tokens equal only where equal in every round; the report lists
    them and checks the target."""
    from mlxdist.bench.compare import _rows, add_ratios, aggregate
    from mlxdist.bench.report import markdown, targets

    def report(plain_tps, spec_tps, equal):
        base = {"dispatch": "collective", "batch": 1, "prompt_tps": 10.0, "peak_memory_gb": [0.1, 0.1]}
        return {"results": [{**base, "generation_tps": plain_tps},
                            {**base, "generation_tps": spec_tps, "speculative": "lookup n=2 k=4",
                             "acceptance": 0.8, "draft_tokens": 40, "draft_tokens_accepted": 32,
                             "tokens_per_forward": 3.2, "forward_ms": 3200 / spec_tps,
                             "plain_forward_ms": 1e3 / plain_tps, "tokens_equal_plain": equal}]}

    trials = []
    for round_, (plain, spec, equal) in enumerate([(10.0, 20.0, True), (20.0, 30.0, True), (10.0, 12.0, False)]):
        trials += _rows(report(plain, spec, equal), "mlxdist", 2, round_)
    rows = aggregate(trials)
    add_ratios(rows)
    spec = next(r for r in rows if r.get("speculative"))
    assert spec["contender"] == "mlxdist collective + lookup n=2 k=4"
    assert spec["vs_plain_rounds"] == [2.0, 1.5, 1.2] and spec["vs_plain"] == 1.5
    assert spec["tokens_equal_plain"] is False
    result = {"results": rows, "versions": {}, "model": "m", "prompt_tokens": 16, "generation_tokens": 32, "rounds": 3,
              "started": "s", "finished": "f", "machine": {"cpus": 2}, "unsupported": {}, "errors": {},
              "batch_sizes": [1], "prompt_kind": "repetitive"}
    (target,) = [t for t in targets(result) if t["contender"] == spec["contender"]]
    # 1.5 x at 80 % acceptance, but one round's tokens differed: not met
    assert target["value"] == 1.5 and target["met"] is False and "not equal" in target["target"]
    text = markdown(result)
    assert "| 2 | mlxdist collective + lookup n=2 k=4 | 20.0 | 1.50 (1.20-2.00) | 80 % (32 / 40) | 3.20 |" in text
