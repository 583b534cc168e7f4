"""CUDA-only checks of the core (run by benchmarks/gpu/run.sh on a GPU machine; skipped here)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.LayerNorm(256), nn.GELU(), nn.Linear(256, 10)).cuda()


def _batch(i):
    g = torch.Generator().manual_seed(i)
    return torch.randn(32, 64, generator=g).cuda(), torch.randint(0, 10, (32,), generator=g).cuda()


@pytest.mark.parametrize("recipe", ["bf16-mixed", "fp16-mixed", "auto"])
def test_recipes_train_on_cuda(recipe):
    mp = mixprec.MixedPrecision(recipe, device="cuda")
    model = mp.prepare(_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for i in range(30):
        x, y = _batch(i % 4)
        with mp.autocast():
            losses.append(mp.step(F.cross_entropy(model(x), y), opt, max_grad_norm=1.0).loss)
    curve = torch.stack(losses).cpu()
    assert torch.isfinite(curve).all() and curve[-4:].mean() < curve[:4].mean()


def test_auto_on_cuda_names_the_device():
    r = mixprec.resolve_recipe("auto", "cuda")
    assert torch.cuda.get_device_name() in r.reason


@pytest.mark.parametrize("opt_cls", [torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD])
def test_step_with_fused_optimizer_makes_no_host_sync(opt_cls):
    mp = mixprec.MixedPrecision("fp16-mixed", device="cuda")
    model = mp.prepare(_model())
    opt = opt_cls(model.parameters(), lr=1e-3, fused=True)
    x, y = _batch(0)
    for _ in range(2):  # warm-up: lazy state creation may sync once
        with mp.autocast():
            loss = F.cross_entropy(model(x), y)
        mp.step(loss, opt, max_grad_norm=1.0)
    torch.cuda.synchronize()
    with mp.autocast():
        loss = F.cross_entropy(model(x), y)
    torch.cuda.set_sync_debug_mode("error")
    try:
        stats = mp.step(loss, opt, max_grad_norm=1.0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not bool(stats.skipped)


def test_matches_torch_gradscaler_on_cuda():
    results = []
    for cls in (torch.amp.GradScaler, mixprec.GradScaler):
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        scaler = cls("cuda", init_scale=2.0**24, growth_interval=3)
        scales = []
        for i in range(40):
            x, y = _batch(i)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            if i % 7 == 3:
                model[0].weight.grad[0, 0] = float("inf")
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            scales.append(scaler.get_scale())
        results.append((scales, [p.detach().clone() for p in model.parameters()]))
    assert results[0][0] == results[1][0]
    for a, b in zip(results[0][1], results[1][1]):
        assert torch.equal(a, b)
