"""The compact strategies' fused update kernels: compiled, they give the eager arithmetic's bits.

The kernels (``mixprec.masters.kernels``) run under ``torch.compile`` for models large enough; the
contract is that nothing about the numbers changes: every kernel is compared bit for bit with the
eager functions on every bf16 pattern, specials and subnormals, and whole training runs are
compared compiled against eager. (Compiling takes a few seconds per kernel the first time in a
process; the FX cache makes later runs faster.)
"""

from __future__ import annotations

import math
import os
import warnings

import pytest
import torch

from mixprec import MixedPrecision
from mixprec.masters import kernels as K
from mixprec.masters.rounding import (
    draw_key,
    join_fp32,
    kahan_add_,
    random_bits16,
    random_bits16_at,
    round_bf16_with_bits,
    split_fp32,
    stochastic_round_bf16,
)

from masters_helpers import assert_bitwise_equal, setup, snapshot, train


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, except that any NaN equals any NaN (their payload is the CPU's choice:
    torch's own fp32 -> bf16 cast gives 0xFFFF with AVX-512 and 0x7FC0 without)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        na, nb = torch.isnan(a), torch.isnan(b)
        ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
        return torch.equal(na, nb) and torch.equal(a[~na].view(ints), b[~nb].view(ints))
    return torch.equal(a, b)


def _patterns(n_random: int = 200_000, seed: int = 0) -> torch.Tensor:
    """fp32 values: every bf16 high half with several low halves (ties, specials, subnormals), and random bits."""
    high = torch.arange(-32768, 32768, dtype=torch.int32) << 16
    lows = torch.tensor([0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int32)
    grid = (high[:, None] | lows[None, :]).flatten()
    g = torch.Generator().manual_seed(seed)
    rand = torch.randint(-(2**31), 2**31, (n_random,), dtype=torch.int64, generator=g).to(torch.int32)
    return torch.cat([grid, rand]).view(torch.float32)


_COMPILED = K.KernelSet("compiled")  # one per module: each kernel compiles once
# torch 2.13's inductor builds its C++ for the CPU it finds, whatever ATEN_CPU_CAPABILITY says, and
# can then fail to compile ("'at::vec' has not been declared", seen with =default and =avx2 on an
# AVX-512 CPU); "auto" falls back to the eager kernels there (with a warning), "compiled" raises.
compiled_only = pytest.mark.skipif(bool(os.environ.get("ATEN_CPU_CAPABILITY")),
                                   reason="ATEN_CPU_CAPABILITY is set: inductor's C++ build may fail under it")


class _Uncompiled:
    """The kernel functions run as plain eager code: their arithmetic against the references,
    without paying for a compile (the compiled runs are the slow job's)."""

    ran = {"compiled"}

    def __call__(self, name, *args):
        return K.KERNELS[name](*args)


KERNEL_RUNS = [pytest.param(_Uncompiled(), id="kernel-eager"),
               pytest.param(_COMPILED, id="compiled", marks=[pytest.mark.slow, compiled_only])]


@pytest.mark.parametrize("compiled", KERNEL_RUNS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compiled_kahan_gives_the_bits_of_kahan_add(compiled, dtype):
    g = torch.Generator().manual_seed(1)
    n = 300_001  # odd: the vector loops' tails run too
    p = (torch.randn(n, generator=g) * torch.logspace(-30, 4, n)).to(dtype)
    p[3::101] = float("inf")
    comp = (torch.randn(n, generator=g) * 1e-3 * p.float()).nan_to_num(0.0).to(dtype)
    stepped = p.float() + torch.randn(n, generator=g) * torch.logspace(-40, 0, n)
    stepped[1::97] = float("inf")
    stepped[2::89] = float("nan")
    stepped[::5] = p[::5].float()  # exactly zero updates (finite p): the pair is left as it was
    ref_p, ref_c = p.clone(), comp.clone()
    kahan_add_(ref_p, ref_c, ref_p.float().neg_().add_(stepped))
    out_p, out_c = p.clone(), comp.clone()
    assert compiled("kahan", out_p, out_c, stepped) is out_p  # both written in place
    assert compiled.ran == {"compiled"}
    assert _same_bits(out_p, ref_p) and _same_bits(out_c, ref_c)
    still = (stepped - p.float()) == 0
    assert still.sum() > n // 6 and torch.equal(out_p[still].view(torch.int16), p[still].view(torch.int16))
    assert torch.equal(out_c[still].view(torch.int16), comp[still].view(torch.int16))  # unmoved where the update is 0


@pytest.mark.parametrize("compiled", KERNEL_RUNS)
def test_compiled_split_and_join_give_the_eager_bits_on_every_pattern(compiled):
    x = _patterns()
    high, rem = split_fp32(x)
    rem_out = torch.empty_like(rem)
    c_high = compiled("split", x, rem_out)
    assert _same_bits(c_high, high) and torch.equal(rem_out, rem)
    assert _same_bits(compiled("join", high, rem), join_fp32(high, rem))
    back = compiled("join", c_high, rem_out)
    ok = ~torch.isnan(x)
    assert torch.equal(back[ok].view(torch.int32), x[ok].view(torch.int32)) and torch.isnan(back[~ok]).all()


@pytest.mark.parametrize("compiled", KERNEL_RUNS)
@pytest.mark.parametrize("start", [0, 1, 12345])
def test_compiled_stochastic_rounding_draws_the_eager_bits(compiled, start):
    x = _patterns(50_000)
    key = draw_key(torch.Generator().manual_seed(2), x.device)
    eager = round_bf16_with_bits(x, random_bits16(x.numel(), key, start))
    assert _same_bits(compiled("sr", x, key, torch.tensor(start)), eager)
    # the element-by-element form of the random stream is the pairwise one, from any start
    idx = torch.arange(start, start + 1000, dtype=torch.int64)
    assert torch.equal(random_bits16_at(idx, key), random_bits16(1000, key, start))
    # and the public function is the stream from 0
    g = torch.Generator().manual_seed(2)
    assert _same_bits(stochastic_round_bf16(x, g), round_bf16_with_bits(x, random_bits16(x.numel(), key)))


def test_the_random_stream_is_uniform_and_its_halves_independent():
    key = draw_key(torch.Generator().manual_seed(3), torch.device("cpu"))
    r = random_bits16(1 << 20, key).double()
    n = r.numel()
    # the mean of U{0..65535} is 32767.5, its std 18918: the sample mean is within 5 stds / sqrt(n)
    assert abs(r.mean().item() - 32767.5) < 5 * 18918 / math.sqrt(n)
    counts = torch.bincount((r // 4096).long(), minlength=16).double()  # 16 equal bins
    chi2 = ((counts - n / 16) ** 2 / (n / 16)).sum().item()
    assert chi2 < 50  # 15 degrees of freedom: P(chi2 > 50) < 1e-5
    def corr(a, b):
        a, b = a - a.mean(), b - b.mean()
        return ((a * b).mean() / (a.std() * b.std())).item()

    bound = 5 / math.sqrt(n / 2)  # 5 standard errors of a correlation between independent samples
    assert abs(corr(r[0::2], r[1::2])) < bound  # the two halves of one hash
    assert abs(corr(r[:-2], r[2:])) < bound  # neighbouring pairs
    other = random_bits16(n, draw_key(torch.Generator().manual_seed(4), torch.device("cpu"))).double()
    assert abs(corr(r, other)) < bound  # the same elements in the next step (another key)
    low_bit = (random_bits16(n, key).remainder(2)).double()  # the bit that decides ties of 2**-16
    assert abs(low_bit.mean().item() - 0.5) < 5 * 0.5 / math.sqrt(n)


@pytest.mark.slow
@compiled_only
@pytest.mark.parametrize("recipe", ["bf16-true-kahan", "bf16-true-sr", "bf16-true-remainder"])
def test_training_with_compiled_kernels_is_bitwise_the_eager_run(recipe, monkeypatch):
    def run(mode, workspace):
        monkeypatch.setenv(K.ENV, mode)
        monkeypatch.setenv("MIXPREC_MASTER_WORKSPACE", workspace)
        model, mp, opt = setup(recipe, accumulate=2)
        assert mp.masters.kernels.mode == mode
        train(model, mp, opt, range(6), poison={3}, max_grad_norm=1.0)  # a skipped step among them
        return mp, snapshot(model, mp, opt)

    # eager kernels on fresh temporaries against compiled ones on the kept temporaries (the default)
    eager_mp, eager = run("eager", "free")
    compiled_mp, comp = run("compiled", "auto")
    assert not eager_mp.masters._ws._bufs and compiled_mp.masters._ws._bufs
    assert "compiled" not in eager_mp.masters.kernels.ran and compiled_mp.masters.kernels.ran == {"compiled"}
    assert "update kernels: eager" in eager_mp.masters.describe()
    assert "update kernels: compiled" in compiled_mp.masters.describe()
    assert_bitwise_equal(eager, comp)


def test_auto_compiles_only_models_large_enough_to_repay_it(monkeypatch):
    monkeypatch.delenv(K.ENV, raising=False)
    ks = K.KernelSet()
    assert ks.mode == "auto"
    ks.size_to(K.AUTO_NUMEL - 1)
    assert not ks.compile and ks.describe() == "eager"
    ks.size_to(K.AUTO_NUMEL)
    assert ks.compile
    _, mp, _ = setup("bf16-true-kahan")  # the tiny test model: eager
    assert not mp.masters.kernels.compile and "update kernels: eager" in mp.masters.describe()


def test_a_failing_compile_falls_back_to_the_same_bits_once_with_a_warning_in_auto(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(torch, "compile", broken)
    ks = K.KernelSet("auto")
    ks.size_to(K.AUTO_NUMEL)
    x = _patterns(1000)
    with pytest.warns(RuntimeWarning, match="torch.compile of the master-weight update kernels failed"):
        high = ks("split", x, torch.empty(x.numel(), dtype=torch.int16))
    assert _same_bits(high, split_fp32(x)[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the next call goes straight to eager
        ks("join", *split_fp32(x))
    assert ks.describe().startswith("eager (torch.compile failed: RuntimeError: no C++ compiler")
    forced = K.KernelSet("compiled")
    with pytest.raises(RuntimeError, match=f"set {K.ENV}=eager"):
        forced("join", *split_fp32(x))


def test_a_bad_kernels_mode_is_refused_with_the_choices(monkeypatch):
    monkeypatch.setenv(K.ENV, "fast")
    with pytest.raises(ValueError, match="MIXPREC_MASTER_KERNELS='fast' is not one of auto, compiled, eager"):
        MixedPrecision("bf16-true-kahan", "cpu")
