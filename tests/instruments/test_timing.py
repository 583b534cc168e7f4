"""The timing harness: interleaving, summaries, paired ratios."""

import collections

import pytest
import torch

from mixprec.instruments.timing import Summary, bootstrap_median_ci, interleaved_order, paired_ratio, time_call


def test_interleaved_order_runs_every_variant_once_per_round():
    order = interleaved_order(["a", "b", "c"], 4)
    assert len(order) == 12
    for r in range(4):
        assert sorted(n for rr, n in order if rr == r) == ["a", "b", "c"]


def test_interleaved_order_rotates_which_variant_goes_first():
    order = interleaved_order(["a", "b"], 4)
    assert [n for _, n in order] == ["a", "b", "b", "a", "a", "b", "b", "a"]
    starts = [interleaved_order(["a", "b", "c"], 6)[3 * r][1] for r in range(6)]
    assert collections.Counter(starts) == {"a": 2, "b": 2, "c": 2}


def test_interleaved_order_refuses_duplicates_and_zero_rounds():
    with pytest.raises(ValueError, match="unique"):
        interleaved_order(["a", "a"], 2)
    with pytest.raises(ValueError, match="rounds"):
        interleaved_order(["a"], 0)


def test_summary_median_and_quartiles():
    s = Summary.of([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s.median, s.q25, s.q75, s.min, s.n) == (3.0, 2.0, 4.0, 1.0, 5)
    assert s.rel_iqr == pytest.approx(2.0 / 3.0)
    with pytest.raises(ValueError):
        Summary.of([])


def test_paired_ratio_is_the_median_of_per_round_ratios():
    # Round 2 is slow for both arms (a load spike): pairing cancels it, a ratio of medians would not.
    a = [1.1, 11.0, 1.1, 1.1]
    b = [1.0, 10.0, 1.0, 1.0]
    r = paired_ratio(a, b)
    assert r["median"] == pytest.approx(1.1)
    assert r["ci95_low"] <= r["median"] <= r["ci95_high"]
    assert r["n"] == 4
    with pytest.raises(ValueError, match="equal length"):
        paired_ratio([1.0], [1.0, 2.0])


def test_bootstrap_interval_brackets_the_median_and_narrows_with_more_data():
    import numpy as np

    rng = np.random.default_rng(1)
    small = rng.normal(1.0, 0.1, 20).tolist()
    large = rng.normal(1.0, 0.1, 2000).tolist()
    lo_s, hi_s = bootstrap_median_ci(small)
    lo_l, hi_l = bootstrap_median_ci(large)
    assert lo_s <= float(np.median(small)) <= hi_s
    assert hi_l - lo_l < hi_s - lo_s


def test_time_call_runs_the_function_repeat_times_and_returns_seconds_per_call():
    calls = []
    t = time_call(lambda: calls.append(1), torch.device("cpu"), repeat=7)
    assert len(calls) == 7 and 0 <= t < 1
