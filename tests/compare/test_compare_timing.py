"""compare's speed column: interleaved timing rounds (as mixprec bench), or loudly indicative."""

from __future__ import annotations

import pytest
import torch

from mixprec.comparison.api import compare
from mixprec.comparison.report import speedup_note, summary_rows
from mixprec.comparison.runner import time_interleaved
from mixprec.recipes import resolve_recipe
from mixprec.tasks import load_task

TINY_CHARLM = {"d_model": 16, "n_layer": 1, "n_head": 2, "seq_len": 16, "batch_size": 4}  # (as conftest.py)


def test_interleaved_timing_rotates_the_order_and_leaves_the_rng_as_it_was():
    task = load_task(None, **TINY_CHARLM)
    order = []
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    recipes = [resolve_recipe(n, "cpu") for n in ("fp32", "bf16-mixed", "fp16-mixed")]
    import mixprec.instruments.timing as timing

    real = timing.time_call

    def spy(fn, device, repeat=1):
        order.append((fn, repeat))
        return real(fn, device, repeat)

    timing.time_call, saved = spy, timing.time_call
    try:
        t = time_interleaved(task, recipes, torch.device("cpu"), rounds=3, warmup=1)
    finally:
        timing.time_call = saved
    assert list(t) == ["fp32", "bf16-mixed", "fp16-mixed"] and all(len(v) == 3 for v in t.values())
    timed = order[3:]  # (the first three: one step of each, to size the rounds)
    assert len(timed) == 9 and len({id(fn) for fn, _ in timed[::3]}) == 3  # a different recipe starts each round
    assert all(r == timed[0][1] > 1 for _, r in timed)  # a step of this tiny model is ms: several per round
    assert torch.equal(torch.random.get_rng_state(), before)


def test_without_timing_rounds_the_speed_column_says_it_is_indicative(tmp_path):
    r = compare(recipes=("bf16-mixed",), steps=6, task_kwargs=TINY_CHARLM, device="cpu", threads=1,
                timing_rounds=0, out=str(tmp_path / "rep"))
    assert r.timing is None and r.speed_method == "sequential"
    assert all(row["speedup_ci"] is None for row in summary_rows(r))
    html = (tmp_path / "rep" / "compare.html").read_text()
    assert '<p class="bad">speedup = ' in html and "INDICATIVE ONLY" in html
    assert "INDICATIVE ONLY" in speedup_note(r)


@pytest.mark.parametrize("rounds", [1, -1, 2.5, True])
def test_timing_rounds_must_be_zero_or_at_least_two(rounds):
    with pytest.raises(ValueError, match="timing_rounds=.*need 0 .* or an integer >= 2"):
        compare(recipes=("bf16-mixed",), steps=4, task_kwargs=TINY_CHARLM, device="cpu", timing_rounds=rounds)
