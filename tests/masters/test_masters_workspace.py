"""MIXPREC_MASTER_WORKSPACE: a bucketed step's flat temporaries kept between steps (CPU): "auto"
(the default) up to 64 MiB, "keep" all of them, "free" none.

The same bits as allocating them afresh, on every strategy, with one bucket and with many of
different sizes, through a skipped step and an exception inside the step; the buffers really are
reused; "auto" keeps no more than its limit and allocates the rest afresh; a bad value is refused
with what to set instead."""

from __future__ import annotations

import pytest
import torch
from masters_helpers import assert_bitwise_equal, setup, snapshot, train

from mixprec._env import WORKSPACE_ENV

RECIPES = ["bf16-true", "bf16-true-kahan", "bf16-true-sr", "bf16-true-remainder", "bf16-pure"]


def _run(recipe, mode, monkeypatch, bucket_numel=None, steps=5, poison=frozenset({2})):
    monkeypatch.setenv(WORKSPACE_ENV, mode)
    if bucket_numel is not None:
        monkeypatch.setattr("mixprec.masters.buckets.BUCKET_NUMEL", bucket_numel)
    model, mp, opt = setup(recipe, optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.1, foreach=True),
                           skip_nonfinite=True)  # the poisoned step is skipped (no recipe here scales the loss)
    monkeypatch.undo()
    stats = train(model, mp, opt, range(steps), poison=poison, max_grad_norm=0.5)
    assert [bool(s.skipped) for s in stats] == [i in poison for i in range(steps)]
    assert all(torch.isfinite(p).all() for p in model.parameters())  # (NaN == NaN bitwise would prove nothing)
    return snapshot(model, mp, opt), mp


@pytest.mark.parametrize("bucket_numel", [None, 300])  # one bucket; many, of different sizes
@pytest.mark.parametrize("recipe", RECIPES)
def test_kept_temporaries_give_the_bits_of_fresh_ones(recipe, bucket_numel, monkeypatch):
    fresh, mp_free = _run(recipe, "free", monkeypatch, bucket_numel)
    kept, mp_keep = _run(recipe, "keep", monkeypatch, bucket_numel)
    auto, mp_auto = _run(recipe, "", monkeypatch, bucket_numel)  # unset: the default
    assert not mp_free.masters._ws._bufs  # "free" keeps nothing
    assert mp_keep.masters._ws._bufs  # "keep" did keep them
    assert mp_auto.masters._ws.mode == "auto" and mp_auto.masters._ws._bufs  # a small model: all kept
    assert mp_auto.masters._ws.kept_bytes == mp_keep.masters._ws.kept_bytes > 0
    assert "MIXPREC_MASTER_WORKSPACE=keep" in mp_keep.describe() and "WORKSPACE" not in mp_free.describe()
    assert "MIXPREC_MASTER_WORKSPACE=auto" in mp_auto.describe() and "up to 64 MiB" in mp_auto.describe()
    assert_bitwise_equal(fresh, kept)
    assert_bitwise_equal(fresh, auto)


@pytest.mark.parametrize("recipe", ["bf16-true-kahan", "bf16-true-sr"])
def test_auto_keeps_no_more_than_its_limit_and_the_rest_is_allocated_each_step(recipe, monkeypatch):
    """A limit below one bucket's temporaries: the buffers that fit are kept and reused, the ones
    that would pass it are made afresh each step, and the bits are those of "free"."""
    fresh, _ = _run(recipe, "free", monkeypatch)
    _, mp_keep = _run(recipe, "keep", monkeypatch)
    sizes = {k: v.numel() * v.element_size() for k, v in mp_keep.masters._ws._bufs.items()}
    limit = max(sizes.values()) + 1  # room for the largest one alone, not for all of them
    assert sum(sizes.values()) > limit
    monkeypatch.setattr("mixprec._env.KEEP_LIMIT_BYTES", limit)
    limited, mp_auto = _run(recipe, "auto", monkeypatch)
    assert_bitwise_equal(fresh, limited)
    ws = mp_auto.masters._ws
    assert ws.limit == limit and 0 < ws.kept_bytes <= limit
    assert ws.kept_bytes == sum(v.numel() * v.element_size() for v in ws._bufs.values())
    assert 0 < len(ws._bufs) < len(sizes)

    monkeypatch.setenv(WORKSPACE_ENV, "auto")  # the kept ones are reused from step to step
    monkeypatch.setattr("mixprec._env.KEEP_LIMIT_BYTES", limit)  # (_run undid it)
    model, mp, opt = setup(recipe)
    train(model, mp, opt, range(2))
    ptrs = {k: v.data_ptr() for k, v in mp.masters._ws._bufs.items()}
    train(model, mp, opt, range(2, 4))
    assert ptrs and {k: v.data_ptr() for k, v in mp.masters._ws._bufs.items()} == ptrs
    assert mp.masters._ws.kept_bytes <= limit


def test_auto_keeps_nothing_off_a_cpu_and_the_plan_counts_nothing_there():
    from mixprec.memory.plan import ParamCounts, facts_from_recipe, plan
    from mixprec.recipes import get_recipe

    counts = ParamCounts(10**6, 0)
    cpu = plan(counts, facts_from_recipe(get_recipe("bf16-true-kahan"), "cpu"))
    cuda = plan(counts, facts_from_recipe(get_recipe("bf16-true-kahan"), "cuda"))
    assert cpu.forward_backward - cuda.forward_backward == 10 * 10**6  # one bucket's 10 B per parameter
    assert any("MIXPREC_MASTER_WORKSPACE=auto" in n for n in cpu.notes)
    assert not any("WORKSPACE" in n for n in cuda.notes)


def test_the_plan_bounds_what_auto_keeps_by_its_limit(monkeypatch):
    from mixprec.memory.plan import ParamCounts, facts_from_recipe, plan
    from mixprec.recipes import get_recipe

    facts = facts_from_recipe(get_recipe("bf16-true-kahan"), "cpu")
    counts = ParamCounts(10**8, 0)  # buckets of 2**24: 160 MiB of temporaries, past the 64 MiB
    free_fb = None
    for mode, extra in (("free", 0), ("auto", 64 << 20), ("keep", 10 * 2**24)):
        monkeypatch.setenv(WORKSPACE_ENV, mode)
        fb = plan(counts, facts).forward_backward
        free_fb = fb if free_fb is None else free_fb
        assert fb - free_fb == extra, mode


def test_the_kept_buffers_are_reused_from_step_to_step(monkeypatch):
    monkeypatch.setenv(WORKSPACE_ENV, "keep")
    model, mp, opt = setup("bf16-true-kahan")
    train(model, mp, opt, range(2))
    ws = mp.masters._ws
    before = {k: v.data_ptr() for k, v in ws._bufs.items()}
    assert {use for use, _, _ in before} >= {"value32", "grad32", "params16"}
    train(model, mp, opt, range(2, 5))
    assert {k: v.data_ptr() for k, v in ws._bufs.items()} == before
    assert not ws.active  # only inside the bucketed step


def test_an_exception_inside_a_kept_step_leaves_the_next_steps_as_fresh_ones_would(monkeypatch):
    def run(mode):
        monkeypatch.setenv(WORKSPACE_ENV, mode)
        monkeypatch.setattr("mixprec.masters.buckets.BUCKET_NUMEL", 300)
        model, mp, opt = setup("bf16-true-kahan", optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3, foreach=True))
        monkeypatch.undo()
        assert len(mp.masters.buckets) >= 4
        train(model, mp, opt, range(2))
        calls = []

        def fail_third(o, a, k):  # the optimizer is called once per bucket: fail in the third one
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("planted")

        handle = opt.register_step_pre_hook(fail_third)
        with pytest.raises(RuntimeError, match="planted"):
            train(model, mp, opt, range(2, 3))
        handle.remove()
        assert not mp.masters._ws.active
        train(model, mp, opt, range(3, 6))
        assert len(calls) == 3 and all(torch.isfinite(p).all() for p in model.parameters())
        return snapshot(model, mp, opt)

    assert_bitwise_equal(run("free"), run("keep"))


def test_a_bad_workspace_value_is_refused_with_the_choices(monkeypatch):
    monkeypatch.setenv(WORKSPACE_ENV, "always")
    with pytest.raises(ValueError, match=r"MIXPREC_MASTER_WORKSPACE='always' is not one of auto, free, keep"):
        setup("bf16-true-kahan")
