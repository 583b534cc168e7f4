"""``mixprec.step_io.clip_or_measure``: torch's ``clip_grad_norm_`` / ``get_total_norm``, the same
bits, without torch's per-call grouping on the common path; and ``mp.step(max_grad_norm=)``
against the hand-written loop that calls torch's clip."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec
from mixprec.step_io import clip_or_measure


def _params(shapes, dtype=torch.float32, seed=0, scale=1.0, none_at=()):
    g = torch.Generator().manual_seed(seed)
    ps = []
    for i, shape in enumerate(shapes):
        p = nn.Parameter(torch.randn(shape, generator=g).to(dtype))
        if i not in none_at:
            p.grad = (torch.randn(shape, generator=g) * scale).to(dtype)
        ps.append(p)
    return ps


def _twin(ps):
    out = []
    for p in ps:
        q = nn.Parameter(p.detach().clone())
        q.grad = None if p.grad is None else p.grad.clone()
        out.append(q)
    return out


SHAPES = [(7, 5), (5,), (3, 4, 2), (1,), (64, 33)]


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, float("inf")])
@pytest.mark.parametrize("max_norm", [None, 0.5, 1e9])
@pytest.mark.parametrize("grad_scale", [1.0, 1e4, 1e-4])
def test_the_same_bits_as_torch_clip_grad_norm(norm_type, max_norm, grad_scale):
    ours = _params(SHAPES, scale=grad_scale, none_at=(3,))
    theirs = _twin(ours)
    got = clip_or_measure(ours, max_norm, norm_type)
    if max_norm is None:
        want = nn.utils.get_total_norm([p.grad for p in theirs if p.grad is not None], norm_type=norm_type)
    else:
        want = nn.utils.clip_grad_norm_(theirs, max_norm, norm_type=norm_type)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want), (got, want)
    for a, b in zip(ours, theirs):
        assert (a.grad is None) == (b.grad is None)
        if a.grad is not None:
            assert torch.equal(a.grad, b.grad)
    if max_norm == 0.5 and got > 0.5:  # the clip was real: the gradients' norm is now the max norm
        assert float(nn.utils.get_total_norm([p.grad for p in ours if p.grad is not None], norm_type)) == \
            pytest.approx(0.5, rel=1e-4)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_non_finite_gradient_gives_torch_s_non_finite_norm_and_gradients(bad):
    ours = _params(SHAPES)
    ours[2].grad[0, 0, 1] = bad
    theirs = _twin(ours)
    got, want = clip_or_measure(ours, 1.0, 2.0), nn.utils.clip_grad_norm_(theirs, 1.0)
    assert torch.equal(got, want) or (got.isnan() and want.isnan())
    for a, b in zip(ours, theirs):
        assert torch.equal(a.grad.nan_to_num(), b.grad.nan_to_num())


def test_mixed_dtypes_and_sparse_gradients_take_torch_s_path_and_agree():
    mixed = _params(SHAPES[:2]) + _params(SHAPES[2:], dtype=torch.bfloat16, seed=1)
    twin = _twin(mixed)
    assert torch.equal(clip_or_measure(mixed, 0.3, 2.0), nn.utils.clip_grad_norm_(twin, 0.3))
    for a, b in zip(mixed, twin):
        assert torch.equal(a.grad, b.grad)

    emb = nn.Embedding(10, 4, sparse=True)  # torch's clip has no sparse norm: ours says the same
    emb(torch.tensor([1, 3, 3])).sum().backward()
    assert emb.weight.grad.is_sparse
    with pytest.raises(NotImplementedError) as theirs:
        nn.utils.clip_grad_norm_(_twin(list(emb.parameters())), 0.1)
    with pytest.raises(NotImplementedError) as ours:
        clip_or_measure(list(emb.parameters()), 0.1, 2.0)
    assert str(ours.value) == str(theirs.value)


def test_no_gradients_give_torch_s_zero():
    ps = _params(SHAPES[:2], none_at=(0, 1))
    assert torch.equal(clip_or_measure(ps, 1.0, 2.0), nn.utils.clip_grad_norm_(_twin(ps), 1.0))
    assert torch.equal(clip_or_measure([], None, 2.0), nn.utils.get_total_norm([]))


def test_the_common_path_does_not_call_torch_s_clip(monkeypatch):
    """The point of the helper: plain fp32 gradients never go through torch's grouping."""
    def refuse(*a, **k):
        raise AssertionError("torch's clip was called on plain gradients")
    monkeypatch.setattr(nn.utils, "clip_grad_norm_", refuse)
    monkeypatch.setattr(nn.utils, "get_total_norm", refuse)
    ps = _params(SHAPES)
    clip_or_measure(ps, 1.0, 2.0)
    clip_or_measure(ps, None, 2.0)


@pytest.mark.parametrize("recipe", ["fp16-mixed", "bf16-mixed", "fp32"])
def test_mp_step_with_a_clip_matches_the_hand_loop_bitwise(recipe):
    """``mp.step(loss, opt, max_grad_norm=)`` against autocast + torch's GradScaler + torch's clip,
    for 30 steps: the same parameters, bit for bit (the clip is active on most steps)."""
    dtype = {"fp16-mixed": torch.float16, "bf16-mixed": torch.bfloat16, "fp32": torch.float32}[recipe]

    def build():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(12, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 2))
        return m, torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False)

    hand, hand_opt = build()
    ours, our_opt = build()
    mp = mixprec.MixedPrecision(recipe, "cpu")
    ours = mp.prepare(ours)
    scaler = torch.amp.GradScaler("cpu", enabled=dtype is torch.float16)
    g = torch.Generator().manual_seed(1)
    clipped = 0
    for _ in range(30):
        x, y = torch.randn(8, 12, generator=g) * 3, torch.randn(8, 2, generator=g)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not torch.float32):
            out = hand(x)
        scaler.scale(((out.float() - y) ** 2).mean()).backward()
        scaler.unscale_(hand_opt)
        norm = nn.utils.clip_grad_norm_(hand.parameters(), 0.05)
        clipped += bool(norm > 0.05)
        scaler.step(hand_opt)
        scaler.update()
        hand_opt.zero_grad(set_to_none=True)

        with mp.autocast():
            out = ours(x)
        stats = mp.step(((out - y) ** 2).mean(), our_opt, max_grad_norm=0.05)
        assert torch.equal(stats.grad_norm, norm)
    assert clipped > 20, "the clip must have been active to prove anything"
    for a, b in zip(hand.parameters(), ours.parameters()):
        assert torch.equal(a, b)
