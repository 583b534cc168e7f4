"""The numbers and the gates: SQNR against its closed form, top-1 with and without near-ties,
top-k, non-finite bookkeeping, and the verdict at its thresholds."""

import math

import pytest
import torch

from mixprec.inference.metrics import OutputStats, flatten_outputs
from mixprec.inference.verdict import Thresholds, judge


def test_sqnr_and_errors_match_their_definitions_over_batches():
    g = torch.Generator().manual_seed(0)
    s = OutputStats("y", (100,), classes=False)
    refs, lows = [], []
    for _ in range(3):
        r = torch.randn(100, generator=g)
        low = r + 1e-3 * torch.randn(100, generator=g)
        s.add(r, low)
        refs.append(r.double()), lows.append(low.double())
    r, low = torch.cat(refs), torch.cat(lows)
    assert s.sqnr == pytest.approx(float(10 * torch.log10((r**2).sum() / ((low - r) ** 2).sum())), rel=1e-12)
    assert s.max_abs_err == pytest.approx(float((low - r).abs().max()), rel=1e-12)
    assert s.rel_err == pytest.approx(float((low - r).abs().max() / r.abs().max()), rel=1e-12)
    assert 55 < s.sqnr < 65  # noise 1e-3 of a unit signal: 60 dB
    equal = OutputStats("y", (2,), classes=False)
    equal.add(torch.ones(2), torch.ones(2))
    assert equal.sqnr == math.inf and equal.rel_err == 0


def test_nonfinite_values_are_counted_and_left_out_of_the_sqnr():
    s = OutputStats("y", (4,), classes=False)
    s.add(torch.tensor([1.0, 2.0, float("-inf"), 4.0]), torch.tensor([1.0, float("inf"), float("-inf"), 4.0]))
    assert (s.nonfinite, s.ref_nonfinite, s.values, s.compared) == (1, 1, 3, 2)
    assert s.sqnr == math.inf  # the two values both made finite are equal
    none = OutputStats("y", (2,), classes=False)
    none.add(torch.ones(2), torch.full((2,), float("nan")))
    assert math.isnan(none.sqnr) and none.nonfinite == 2


def test_top1_counts_near_tie_flips_apart_from_decisive_ones():
    ref = torch.tensor([
        [0.0, 5.0, 10.0, 9.99],  # near tie: 10 vs 9.99 (within 1% of the range 10)
        [0.0, 5.0, 10.0, 9.0],   # decisive: 10 vs 9 (10% of the range)
        [3.0, 0.0, 1.0, 2.0],    # agrees
        [3.0, 0.0, 1.0, 2.0],    # low precision made a NaN: no pick at all
    ])
    low = ref.clone()
    low[0, 3], low[1, 3] = 10.01, 10.5  # both flip to class 3
    low[3, 1] = float("nan")
    s = OutputStats("logits", (4, 4), classes=True, topk=2)
    s.add(ref, low)
    assert s.rows == 4
    assert s.top1 == pytest.approx(1 / 4)
    assert s.top1_ties_aside == pytest.approx(2 / 4)
    assert s.topk_mean == pytest.approx((2 + 2 + 2 + 0) / 2 / 4)  # a row with a NaN shares nothing


def test_class_rows_fp32_cannot_decide_are_left_out():
    ref = torch.tensor([[float("-inf")] * 3, [1.0, 2.0, float("-inf")]])  # all masked; one masked class
    s = OutputStats("logits", (2, 3), classes=True)
    s.add(ref, ref.clone())
    assert s.rows == 1 and s.top1 == 1.0 and s.topk_mean is None  # 3 classes: no top-5


def test_flatten_names_a_tensor_a_mapping_and_a_nest():
    out = {"logits": torch.ones(1), "hidden_states": (torch.ones(1), torch.ones(1)), "past_key_values": object()}
    assert [n for n, _ in flatten_outputs(out)] == ["logits", "hidden_states[0]", "hidden_states[1]"]
    assert [n for n, _ in flatten_outputs(torch.ones(1))] == ["output"]
    assert [n for n, _ in flatten_outputs((torch.ones(1), [torch.ones(1)]))] == ["[0]", "[1][0]"]


def _stats(sqnr_db: float, top1: float | None = None, nonfinite: int = 0) -> OutputStats:
    s = OutputStats("y", (10,), classes=top1 is not None, signal=1.0, noise=10 ** (-sqnr_db / 10), compared=10,
                    values=10, nonfinite=nonfinite)
    if top1 is not None:
        s.rows, s.top1_agree_ties = 1000, round(top1 * 1000)
    return s


@pytest.mark.parametrize("sqnr, top1, verdict", [
    (30.0, None, "agree"), (29.9, None, "degraded"), (20.0, None, "degraded"), (19.9, None, "broken"),
    (50.0, 0.99, "agree"), (50.0, 0.989, "degraded"), (50.0, 0.90, "degraded"), (50.0, 0.899, "broken"),
    (25.0, 0.5, "broken"),
])
def test_verdict_gates(sqnr, top1, verdict):
    assert judge(_stats(sqnr, top1), Thresholds())[0] == verdict


def test_any_nonfinite_value_is_broken_and_the_reasons_name_the_output():
    v, reasons = judge(_stats(80.0, nonfinite=1), Thresholds())
    assert v == "broken" and reasons == ["y: 1 non-finite value(s) where fp32 is finite"]
    assert judge(_stats(25.0), Thresholds(agree_sqnr_db=25, broken_sqnr_db=10))[0] == "agree"


def test_thresholds_refuse_an_inverted_gate():
    with pytest.raises(ValueError, match="broken_sqnr_db"):
        Thresholds(agree_sqnr_db=10, broken_sqnr_db=20)
    with pytest.raises(ValueError, match="broken_top1"):
        Thresholds(agree_top1=0.5, broken_top1=0.9)
