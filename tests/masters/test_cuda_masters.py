"""Master weights on CUDA (skipped without a GPU; run by the GPU job)."""

from __future__ import annotations

import pytest
import torch
from masters_helpers import assert_bitwise_equal, setup, snapshot, train

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("recipe", ["bf16-true", "fp16-true"])
def test_storage_recipe_trains_bitwise_like_its_mixed_twin_on_cuda(recipe):
    twin = recipe.replace("-true", "-mixed")
    ref, mp_ref, opt_ref = setup(twin, device="cuda")
    model, mp, opt = setup(recipe, device="cuda")
    # an inf loss is a skipped step under fp16's scaler; bf16 has no scaler (it would step NaN)
    poison = {1} if recipe.startswith("fp16") else set()
    a = train(ref, mp_ref, opt_ref, range(3), poison=poison)
    b = train(model, mp, opt, range(3), poison=poison)
    assert [float(s.loss) for s in a] == [float(s.loss) for s in b]
    masters = mp.masters.masters()
    for name, p in ref.named_parameters():
        assert torch.equal(masters.get(name, dict(model.named_parameters())[name]), p), name


@pytest.mark.parametrize("recipe", ["bf16-true-sr", "bf16-true-kahan", "bf16-true-remainder"])
def test_compact_strategies_resume_bit_for_bit_on_cuda(recipe):
    model, mp, opt = setup(recipe, device="cuda")
    train(model, mp, opt, range(2))
    ckpt = snapshot(model, mp, opt)
    train(model, mp, opt, range(2, 4))
    expected = snapshot(model, mp, opt)
    model2, mp2, opt2 = setup(recipe, seed=1, device="cuda")
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    mp2.load_state_dict(ckpt["mp"])
    train(model2, mp2, opt2, range(2, 4))
    assert_bitwise_equal(expected, snapshot(model2, mp2, opt2))


@pytest.mark.parametrize("recipe", ["bf16-true-kahan", "bf16-true-sr", "bf16-true-remainder", "fp16-true"])
def test_bucketed_step_on_cuda_is_bitwise_the_whole_step_and_never_syncs(recipe, monkeypatch):
    # fp16-true: its loss scaler checks the deferred fp16 gradients on the device (fused AdamW skips there)
    from mixprec.masters.base import MasterWeights
    from mixprec.tasks.charlm import lm_loss

    fused = lambda ps: torch.optim.AdamW(ps, lr=3e-3, fused=True)  # noqa: E731

    def run(bucketed, clip):
        monkeypatch.setattr("mixprec.masters.buckets.BUCKET_NUMEL", 300)  # several buckets
        if not bucketed:
            monkeypatch.setattr(MasterWeights, "can_step_in_buckets", lambda self, opts: False)
        model, mp, opt = setup(recipe, device="cuda", optimizer=fused)
        train(model, mp, opt, range(2), max_grad_norm=clip)  # the optimizer state exists from here on
        x = torch.randint(0, 96, (4, 16), device="cuda")
        with mp.autocast():
            loss = lm_loss(model(x), torch.roll(x, -1, dims=1))
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            mp.step(loss, opt, max_grad_norm=clip)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert mp.masters.in_buckets is False and len(mp.masters.buckets) > 1
        out = snapshot(model, mp, opt)
        monkeypatch.undo()
        return out

    # without clipping bitwise; the clip's norm over deferred bf16 gradients may differ from the
    # norm over their fp32 copies in the last bits on CUDA (the kernel's load path differs), so
    # with clipping only the absence of host syncs is checked
    assert_bitwise_equal(run(False, None), run(True, None))
    run(True, 1.0)
