"""fp32 islands and fp32-statistics norms, against float64 references."""

import pytest
import torch
from torch import nn

from mixprec import Fp32GroupNorm, Fp32LayerNorm, Fp32RMSNorm, fp32_island, keep_fp32
from mixprec.islands import island_names, remove_fp32_islands


def _rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).norm() / ref.norm()).item()


class Probe(nn.Module):
    """Records the dtypes it computes in."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen = []

    def forward(self, x):
        y = self.lin(x)
        self.seen.append((x.dtype, y.dtype))
        return y


def test_island_runs_in_fp32_under_autocast_and_returns_the_16_bit_dtype():
    net = nn.Sequential(nn.Linear(4, 4), Probe())
    assert keep_fp32(net, ["1"]) == ["1"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = net(torch.randn(2, 4))
    assert net[1].seen == [(torch.float32, torch.float32)]
    assert out.dtype == torch.bfloat16


def test_island_is_more_accurate_than_16_bit_compute():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64))
    x = torch.randn(32, 64)
    with torch.no_grad():
        ref = nn.functional.layer_norm(net[0](x).double(), (64,), net[1].weight.double(), net[1].bias.double())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            plain = net(x)
        keep_fp32(net, ["norms"])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            island = net(x)
    # both see the same bf16 linear output; the island only removes the norm's own bf16 error
    assert island.dtype == plain.dtype == torch.bfloat16
    assert _rel_err(island, ref) <= _rel_err(plain, ref)


def test_autocast_is_restored_when_the_island_raises():
    class Boom(nn.Module):
        def forward(self, x):
            raise KeyError("boom")

    net = nn.Sequential(Boom())
    keep_fp32(net, [Boom])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(KeyError):
            net(torch.randn(1, 2))
        assert torch.is_autocast_enabled("cpu")


def test_rules_by_class_name_predicate_and_nesting():
    net = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2)), nn.Linear(2, 2))
    assert keep_fp32(net, ["0"]) == ["0"]  # the LayerNorm inside is covered by the outer island
    assert island_names(net) == ["0"]
    assert remove_fp32_islands(net) == 1 and island_names(net) == []
    assert not net[0]._forward_hooks and not net[0]._forward_pre_hooks
    assert keep_fp32(net, [lambda name, m: name == "1"]) == ["1"]
    assert keep_fp32(net, ["LayerNorm"]) == ["0.1"]


def test_rule_that_matches_nothing_is_an_error_not_silence():
    with pytest.raises(ValueError, match="'haed' matches no submodule"):
        keep_fp32(nn.Sequential(nn.Linear(2, 2)), ["haed"])


def test_fp32_island_context_turns_autocast_off():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with fp32_island():
            assert not torch.is_autocast_enabled("cpu")
            y = torch.randn(2, 2) @ torch.randn(2, 2)
        assert torch.is_autocast_enabled("cpu")
    assert y.dtype == torch.float32


def _tiny_activations(dtype):
    # Activations of size ~1e-4 (normal fp16 numbers): their squares, ~1e-8, fall below fp16's
    # subnormal floor (get_format("f16").smallest_subnormal ~ 6e-8), so a 16-bit variance is ~0.
    g = torch.Generator().manual_seed(0)
    return (1e-4 * torch.randn(8, 256, generator=g, dtype=torch.float64)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp32_layernorm_matches_float64_on_tiny_variances(dtype):
    x16 = _tiny_activations(dtype)
    ref = nn.functional.layer_norm(x16.double(), (256,), eps=1e-12)
    out = Fp32LayerNorm(256, eps=1e-12).to(dtype)(x16)
    assert out.dtype == dtype
    assert _rel_err(out, ref) < 0.01


def test_a_16_bit_hand_written_layernorm_fails_where_the_fp32_one_does_not():
    x16 = _tiny_activations(torch.float16)
    ref = nn.functional.layer_norm(x16.double(), (256,), eps=1e-12)
    mu = x16.mean(-1, keepdim=True)
    var = ((x16 - mu) ** 2).mean(-1, keepdim=True)  # 16-bit statistics, as a custom norm might keep
    naive = (x16 - mu) / torch.sqrt(var + 1e-12)
    assert not torch.isfinite(naive).all() or _rel_err(naive, ref) > 0.5
    assert _rel_err(Fp32LayerNorm(256, eps=1e-12).half()(x16), ref) < 0.01


def test_fp32_group_and_rms_norms_match_float64():
    x = torch.randn(4, 8, 16, dtype=torch.float64)
    gn = Fp32GroupNorm(2, 8).to(torch.bfloat16)
    ref = nn.functional.group_norm(x.to(torch.bfloat16).double(), 2)
    assert _rel_err(gn(x.to(torch.bfloat16)), ref) < 0.01
    rms = Fp32RMSNorm(16).to(torch.float16)
    xh = x.to(torch.float16)
    ref = xh.double() / torch.sqrt(xh.double().pow(2).mean(-1, keepdim=True) + 1e-6)
    assert _rel_err(rms(xh), ref) < 2e-3
    assert "eps=1e-06" in repr(rms)


_NEUTRAL_CASES = [
    (lambda: nn.LayerNorm(16), (4, 16)),
    (lambda: nn.GroupNorm(4, 16), (4, 16, 5)),
    (lambda: nn.BatchNorm1d(16), (4, 16)),
    (lambda: nn.BatchNorm2d(16), (4, 16, 3, 3)),
    (lambda: nn.InstanceNorm1d(16, affine=True), (4, 16, 5)),
    (lambda: nn.LocalResponseNorm(3), (4, 16, 5)),
] + ([(lambda: nn.RMSNorm(16), (4, 16))] if hasattr(nn, "RMSNorm") else [])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("make,shape", _NEUTRAL_CASES)
def test_norm_islands_leave_autocast_on_and_still_compute_in_fp32(make, shape, dtype):
    # Built-in norms run no op autocast lowers, so their island only casts (compile-friendly);
    # the result must equal the module run on fp32 inputs with autocast off, bit for bit.
    torch.manual_seed(0)
    norm = make()
    with torch.no_grad():
        for p in norm.parameters():
            p.uniform_(0.5, 1.5)
    x = (torch.randn(shape) * 3 + 1).to(dtype)
    want = norm(x.float()).to(dtype)  # no autocast anywhere: plain fp32
    keep_fp32(norm, ["norms"])
    seen = []
    norm.register_forward_pre_hook(lambda m, a: seen.append(torch.is_autocast_enabled("cpu")))
    with torch.autocast("cpu", dtype=dtype):
        got = norm(x)
    assert seen == [True]  # autocast was left on inside
    assert got.dtype == dtype and torch.equal(got, want)


@pytest.mark.parametrize("make,shape", _NEUTRAL_CASES)
def test_a_norm_island_given_fp32_under_autocast_runs_exactly_the_plain_modules_ops(make, shape):
    # the common call in a transformer (an fp32 residual stream into a norm island): nothing to cast,
    # so not one aten op beyond the module's own (counted exactly, not timed)
    import collections

    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func)] += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    plain, island = make(), make()
    island.load_state_dict(plain.state_dict())
    keep_fp32(island, ["norms"])
    x = torch.randn(shape, requires_grad=True)
    counts = []
    for m in (plain, island):
        with Count() as c, torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(x)
        counts.append(c.ops)
        assert out.dtype == torch.float32
    assert counts[0] == counts[1]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(island(x), plain(x))


def test_an_island_around_a_matmul_still_switches_autocast_off():
    lin = nn.Linear(16, 16)
    x = torch.randn(4, 16)
    want = lin(x).to(torch.bfloat16)
    keep_fp32(lin, [nn.Linear])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = lin(x.to(torch.bfloat16))
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, lin(x.to(torch.bfloat16).float()).to(torch.bfloat16))
    # a bf16 matmul would differ from the fp32 one on these inputs
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = nn.functional.linear(x.to(torch.bfloat16), lin.weight, lin.bias)
    assert not torch.equal(plain, want)


def test_a_norm_subclass_is_not_assumed_neutral():
    class LNWithProjection(nn.LayerNorm):  # a subclass may add a matmul
        def __init__(self, n):
            super().__init__(n)
            self.proj = nn.Linear(n, n)

        def forward(self, x):
            return self.proj(super().forward(x))

    m = LNWithProjection(16)
    x = torch.randn(4, 16)
    want = m(x)
    keep_fp32(m, ["norms"])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = m(x)
    assert got.dtype == torch.float32 and torch.equal(got, want)
