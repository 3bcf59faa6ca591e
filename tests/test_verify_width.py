"""The verify width auto chooses for speculative decoding (engine/verify_width.py;
the counts it is chosen from: test_bench_speculative's DraftTally test)."""

import pytest

from mlxdist.engine.verify_width import START, VerifyWidths, best_width, tokens_per_forward


def test_tokens_per_forward_counts_the_kept_drafts_and_the_models_token():
    assert tokens_per_forward(3, 0.5) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert tokens_per_forward(4, 1.0) == 5
    assert tokens_per_forward(4, 0.0) == 1


@pytest.mark.parametrize("acceptance,t0,t1,width", [
    (0.9, 10.0, 0.1, 16),  # a forward costs the link, each draft little: as wide as allowed
    (0.3, 10.0, 0.1, 3),  # poor drafts: 1.42 tokens at k = 3 against 1.39 at 2 and 1.43 at 4 for 4 % more time
    (0.5, 1.0, 1.0, 1),  # each draft costs as much as the forward: 1.5 tokens / 2 against 1.75 / 3
])
def test_best_width_has_the_most_tokens_a_second(acceptance, t0, t1, width):
    assert best_width(acceptance, t0, t1) == width


def test_widths_start_at_mlx_lms_default_then_measure_a_second_then_fit():
    widths = VerifyWidths()
    assert widths.choose("lookup")[0] == START == 3
    widths.record("lookup", 3, kept=90, rejected=10, seconds=10.0, forwards=100)  # 0.1 s a forward
    assert widths.choose("lookup")[0] == 4  # mostly kept: one wider
    widths.record("lookup", 4, kept=45, rejected=5, seconds=5.5, forwards=50)  # 0.11 s
    record = widths.records["lookup"]
    assert record.acceptance == pytest.approx(136 / 152)
    t0, t1 = record.line()
    assert (t0, t1) == (pytest.approx(0.07), pytest.approx(0.01))
    # 6.01 tokens in 0.15 s at k = 8, against 5.60 in 0.14 at 7 and 6.38 in 0.16 at 9
    width, line = widths.choose("lookup")
    assert width == best_width(136 / 152, 0.07, 0.01) == 8
    assert "drafts 8 tokens a forward (acceptance 0.89" in line
    assert widths.choose("the draft model")[0] == START  # each drafter measured on its own


def test_poor_drafts_try_a_narrower_second_width():
    widths = VerifyWidths()
    widths.record("d", 3, kept=2, rejected=20, seconds=1.0, forwards=20)
    assert widths.choose("d")[0] == 2
    widths.record("d", 2, kept=1, rejected=10, seconds=0.4, forwards=10)  # 0.04 s a forward, 0.05 at 3
    assert widths.choose("d")[0] == 1  # 11 % kept: 1.11 tokens in 0.03 s against 1.13 in 0.04 at k = 2


def test_a_line_never_slopes_down():
    widths = VerifyWidths()
    widths.record("d", 3, kept=9, rejected=1, seconds=2.0, forwards=10)  # noise: the wider was faster
    widths.record("d", 5, kept=9, rejected=1, seconds=1.0, forwards=10)
    t0, t1 = widths.records["d"].line()
    assert t1 == 0 and t0 == pytest.approx(0.15)
    assert widths.choose("d")[0] == 10  # drafts look free: wider, but no more than twice the widest measured

