"""``attention="fp32"``: the attention product of a bf16 autocast forward runs on fp32 copies of q,
k, v, forward and backward; it is the more exact of the two against float64; nothing outside the
model's forward is touched."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec_test_env import bf16_sdpa_error


class Attn(nn.Module):
    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)


def _run(attention, x):
    torch.manual_seed(0)
    mp = mixprec.MixedPrecision("bf16-mixed", "cpu", attention=attention)
    model = mp.prepare(Attn())
    xr = x.clone().requires_grad_()
    with mp.autocast():
        out = model(xr)
    out.float().square().sum().backward()
    return mp, model, out, xr.grad


def _reference(x):
    """The same computation in float64 from the same bf16-rounded q, k, v the autocast forward makes."""
    torch.manual_seed(0)
    model = Attn()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        qkv = model.qkv(x)
    B, T, C = x.shape
    q, k, v = qkv.double().view(B, T, 3, 4, C // 4).permute(2, 0, 3, 1, 4)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)


def test_fp32_attention_is_nearer_float64_than_bf16_attention_and_trains():
    if bf16_sdpa_error():
        pytest.skip(bf16_sdpa_error())
    x = torch.randn(4, 64, 32, generator=torch.Generator().manual_seed(1))
    ref = _reference(x)
    mp32, model32, out32, g32 = _run("fp32", x)
    _, _, out16, g16 = _run("recipe", x)
    assert out32.dtype == out16.dtype  # (the product gives bf16 either way; the prepared model casts its output to fp32)

    def rel(a):
        return ((a.double() - ref).norm() / ref.norm()).item()

    # fp32 attention: only the final cast to bf16 rounds (relative error <= 2**-9 per element);
    # bf16 attention also rounds the scores and probabilities inside
    assert rel(out32) <= 2.0**-8
    assert rel(out32) < rel(out16)
    assert torch.isfinite(g32).all() and g32.abs().sum() > 0
    assert model32.qkv.weight.grad is not None
    assert mp32.attention.calls == {"fp32": 1, "recipe": 0}


def test_only_the_prepared_models_forward_is_routed():
    x = torch.randn(2, 8, 32)
    mp, model, _, _ = _run("fp32", x)
    assert not torch.overrides._get_current_function_mode_stack()  # nothing left active after the forward
    q = torch.randn(2, 4, 8, 8, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        F.scaled_dot_product_attention(q, q, q)  # outside the model: as torch does it
    assert mp.attention.calls["fp32"] == 1
    assert "attention: fp32" in mp.describe()


def test_fp32_attention_with_16_bit_storage_and_the_nan_guard():
    torch.manual_seed(0)
    mp = mixprec.MixedPrecision("bf16-true", "cpu", attention="fp32", nan_guard=True)
    model = mp.prepare(Attn())
    opt = torch.optim.AdamW(mp.parameters(model), lr=1e-3)
    for _ in range(2):
        with mp.autocast():
            out = model(torch.randn(2, 8, 32))
        mp.step(out.float().square().mean(), opt)
    assert mp.attention.calls["fp32"] == 2 and mp.guard.events == []
    with torch.no_grad():  # an evaluation forward outside mp.autocast(): the model's own autocast, same routing
        model(torch.randn(2, 8, 32))
    assert mp.attention.calls["fp32"] == 3


def test_attention_options_are_checked():
    with pytest.raises(ValueError, match="attention='always' is not one of recipe, fp32, fastest"):
        mixprec.MixedPrecision("bf16-mixed", "cpu", attention="always")
    assert mixprec.MixedPrecision("fp32", "cpu", attention="fp32").prepare(Attn()) is not None  # fp32 compute: nothing to route
    assert mixprec.get_recipe("bf16-mixed").attention == "recipe"
