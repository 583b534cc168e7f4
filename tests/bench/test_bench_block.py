"""The reference block: its FLOP formula against torch's counter, and what it computes."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from mixprec.bench.block import SHAPES, RefBlock, Shape, block_flops, get_shape, loss_fn, make_batches, matmul_params


def _counted(shape: Shape) -> tuple[int, int]:
    torch.manual_seed(0)
    model = RefBlock(shape)
    x, _ = make_batches(shape, "cpu", count=1)[0]
    # The math backend decomposes attention into bmm, which the counter sees; the fused CPU kernel
    # is invisible to it.
    with sdpa_kernel(SDPBackend.MATH):
        with FlopCounterMode(display=False) as fwd:
            out = model(x)
        with FlopCounterMode(display=False) as bwd:
            out.pow(2).mean().backward()
    return fwd.get_total_flops(), bwd.get_total_flops()


@pytest.mark.parametrize("shape", [SHAPES["tiny"], Shape("odd", d_model=48, n_head=3, batch=3, seq=10, mlp_ratio=2)])
def test_flop_formula_equals_torch_flop_counter_forward_and_backward(shape):
    fwd, bwd = _counted(shape)
    flops = block_flops(shape)
    assert flops["forward"] == fwd
    assert flops["backward"] == bwd
    assert flops["step"] == fwd + bwd


def test_matmul_params_are_the_linear_weights():
    shape = SHAPES["tiny"]
    model = RefBlock(shape)
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert matmul_params(shape) == weights == 12 * shape.d_model**2


def _reference_block(model: RefBlock, x: torch.Tensor) -> torch.Tensor:
    """The pre-LN block written out with explicit softmax attention."""
    B, T, C = x.shape
    nh, hs = model.n_head, C // model.n_head
    h = F.layer_norm(x, (C,), model.ln1.weight, model.ln1.bias, model.ln1.eps)
    q, k, v = (h @ model.qkv.weight.T + model.qkv.bias).split(C, dim=-1)
    q, k, v = (t.view(B, T, nh, hs).transpose(1, 2) for t in (q, k, v))
    att = ((q @ k.transpose(-2, -1)) / math.sqrt(hs)).softmax(-1)
    x = x + (att @ v).transpose(1, 2).reshape(B, T, C) @ model.proj.weight.T + model.proj.bias
    h = F.layer_norm(x, (C,), model.ln2.weight, model.ln2.bias, model.ln2.eps)
    return x + F.gelu(h @ model.fc.weight.T + model.fc.bias) @ model.out.weight.T + model.out.bias


def test_ref_block_is_a_bidirectional_pre_ln_block_in_float64():
    shape = SHAPES["tiny"]
    torch.manual_seed(0)
    model = RefBlock(shape).double()
    x = torch.randn(shape.batch, shape.seq, shape.d_model, dtype=torch.float64)
    got, want = model(x), _reference_block(model, x)
    assert torch.linalg.norm(got - want) / torch.linalg.norm(want) < 1e-12


def test_loss_is_fp32_from_16bit_outputs():
    out = torch.randn(2, 3, dtype=torch.bfloat16)
    assert loss_fn(out, torch.randn(2, 3)).dtype == torch.float32


def test_batches_are_deterministic_and_not_zero():
    a = make_batches(SHAPES["tiny"], "cpu", count=2)
    b = make_batches(SHAPES["tiny"], "cpu", count=2)
    assert all(torch.equal(p, q) for (p, _), (q, _) in zip(a, b))
    assert not torch.equal(a[0][0], a[1][0])
    assert a[0][0].count_nonzero() == a[0][0].numel()


def test_shape_with_indivisible_heads_is_refused():
    with pytest.raises(ValueError, match="not divisible by n_head"):
        Shape("bad", d_model=30, n_head=4, batch=1, seq=1)


def test_unknown_shape_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="ref, cpu, small, tiny"):
        get_shape("huge")
    assert get_shape("ref").d_model == 1024 and get_shape("ref").tokens == 32 * 512
