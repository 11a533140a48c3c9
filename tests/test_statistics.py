"""The numbers behind the run summary: Wilson intervals and the paired test, checked against known values."""

import json

import pytest

from shared.evaluation.statistics import paired_comparison, solved_by_seed, wilson_interval


def test_wilson_interval_matches_published_values():
    # Wilson (1927) / Newcombe (1998) example: 81/263 -> [0.2553, 0.3662]
    low, high = wilson_interval(81, 263)
    assert (round(low, 4), round(high, 4)) == (0.2553, 0.3662)
    # Stays inside [0, 1] at the edges, where the normal interval would leave it.
    assert wilson_interval(0, 10)[0] == 0.0 and 0.27 < wilson_interval(0, 10)[1] < 0.28
    assert wilson_interval(10, 10)[1] == pytest.approx(1.0) and 0.72 < wilson_interval(10, 10)[0] < 0.73
    # 64 mazes at 40%: about +-12 points; 512 mazes: about +-4 (the low-noise set).
    assert 0.23 < wilson_interval(26, 64)[1] - wilson_interval(26, 64)[0] < 0.25
    assert 0.08 < wilson_interval(205, 512)[1] - wilson_interval(205, 512)[0] < 0.09


def test_paired_comparison_counts_only_discordant_mazes():
    before = {seed: seed < 40 for seed in range(100)}           # solves 0-39
    after = {seed: 2 <= seed < 50 for seed in range(100)}       # loses 0-1, gains 40-49
    result = paired_comparison(before, after)
    assert (result["mazes"], result["gained"], result["lost"]) == (100, 10, 2)
    assert result["difference"] == pytest.approx(0.08)
    # Wald interval of paired proportions: se = sqrt(b + c - (b - c)^2 / n) / n = sqrt(12 - 0.64) / 100
    se = (12 - 64 / 100) ** 0.5 / 100
    assert result["ci_low"] == pytest.approx(0.08 - 1.959964 * se) and result["ci_high"] == pytest.approx(0.08 + 1.959964 * se)
    # McNemar's exact test: 2 * P(X <= 2), X ~ Binomial(12, 1/2) = 2 * (1 + 12 + 66) / 4096
    assert result["p_value"] == pytest.approx(2 * 79 / 4096)
    # Same policy twice: no change, p = 1.
    same = paired_comparison(before, before)
    assert (same["difference"], same["ci_low"], same["ci_high"], same["p_value"]) == (0.0, 0.0, 0.0, 1.0)
    with pytest.raises(ValueError, match="same mazes"):
        paired_comparison(before, {0: True})


def test_solved_by_seed_reads_an_eval_folder(tmp_path):
    records = [{"seed": 7, "solved": True}, {"seed": 3, "solved": False}]
    (tmp_path / "episodes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert solved_by_seed(tmp_path) == {7: True, 3: False}


def test_paired_mean_difference_by_hand():
    """Per-maze success shares (mean@k) before and after, paired over mazes: diffs 0.5, 0.25, 0."""
    import math

    from shared.evaluation.statistics import paired_mean_difference

    result = paired_mean_difference({1: 0.5, 2: 0.0, 3: 1.0}, {1: 1.0, 2: 0.25, 3: 1.0})
    se = 0.25 / math.sqrt(3)  # the diffs' sample sd is 0.25
    assert result["difference"] == pytest.approx(0.25)
    assert (result["ci_low"], result["ci_high"]) == pytest.approx((0.25 - 1.959964 * se, 0.25 + 1.959964 * se))
    assert result["p_value"] == pytest.approx(math.erfc(0.25 / se / math.sqrt(2)))
    assert result["p_value"] == pytest.approx(0.0833, abs=1e-4)  # z = 1.732, two-sided
    assert paired_mean_difference({1: 0.5}, {1: 0.5})["p_value"] == 1.0
