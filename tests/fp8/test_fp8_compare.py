"""mixprec compare sees fp8: the fp8 recipes TRACK fp32 on the built-in task, a planted bad choice DIVERGES."""

from __future__ import annotations

import pytest

from mixprec.comparison.api import compare

#: the built-in char GPT, shrunk (as tests/compare does) so that six runs take seconds on two busy cores
TINY_CHARLM = {"d_model": 16, "n_layer": 1, "n_head": 2, "seq_len": 16, "batch_size": 4}


@pytest.fixture(scope="module")
def fp8_comparison():
    return compare(recipes=("fp32", "fp8-current", "fp8-delayed", "fp8-unscaled"), steps=60, task_kwargs=TINY_CHARLM,
                   device="cpu", threads=1)


def test_fp8_current_and_delayed_track_fp32_on_the_builtin_task(fp8_comparison):
    for name in ("fp8-current", "fp8-delayed"):
        v = fp8_comparison.verdicts[name]
        assert v.status == "TRACKS", f"{name}: {v.message}"
        assert v.ratio < 0.5  # well inside fp32's noise band


def test_unscaled_e4m3_gradients_diverge_and_the_comparison_says_so(fp8_comparison):
    # every linear in fp8, e4m3 for the gradients and no scaling: gradients of ~1e-3 flush to zero
    # (e4m3's smallest subnormal is 2**-9), so the loss falls far more slowly than fp32's
    v = fp8_comparison.verdicts["fp8-unscaled"]
    assert v.status == "DIVERGES", v.message
    assert fp8_comparison.run_for("fp8-unscaled").loss[-10:].mean() > fp8_comparison.reference.loss[-10:].mean() + 0.1
