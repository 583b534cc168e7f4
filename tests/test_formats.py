"""The format table against the definitions (bit layouts) and torch.finfo."""

import pytest
import torch

from mixprec.formats import format_names, get_format, short_name


@pytest.mark.parametrize(
    "name,dtype,e,m,max_,tiny,sub",
    [
        ("f32", torch.float32, 8, 23, (2 - 2.0**-23) * 2.0**127, 2.0**-126, 2.0**-149),
        ("bf16", torch.bfloat16, 8, 7, (2 - 2.0**-7) * 2.0**127, 2.0**-126, 2.0**-133),
        ("f16", torch.float16, 5, 10, 65504.0, 2.0**-14, 2.0**-24),
        ("e4m3", torch.float8_e4m3fn, 4, 3, 448.0, 2.0**-6, 2.0**-9),
        ("e5m2", torch.float8_e5m2, 5, 2, 57344.0, 2.0**-14, 2.0**-16),
    ],
)
def test_limits_match_the_bit_layout(name, dtype, e, m, max_, tiny, sub):
    f = get_format(name)
    assert (f.dtype, f.exponent_bits, f.mantissa_bits) == (dtype, e, m)
    assert (f.max, f.tiny, f.smallest_subnormal, f.eps) == (max_, tiny, sub, 2.0**-m)
    assert f.bits == 1 + e + m


@pytest.mark.parametrize("name", ["f16", "bf16", "e4m3", "e5m2"])
def test_smallest_subnormal_is_representable_and_half_of_it_flushes(name):
    f = get_format(name)
    t = torch.tensor([f.smallest_subnormal, f.smallest_subnormal * 0.49], dtype=torch.float64).to(f.dtype)
    assert t[0].item() == f.smallest_subnormal and t[1].item() == 0.0


def test_update_vanishes_below_half_an_eps_as_the_seeds_say():
    """fp16: x + d returns x when |d| < |x| * 2**-11 (round to nearest)."""
    f = get_format("f16")
    one = torch.tensor(1.0, dtype=torch.float16)
    assert f.update_vanishes_below() == 2.0**-11
    assert (one + torch.tensor(2.0**-12, dtype=torch.float16)).item() == 1.0
    assert (one + torch.tensor(2.0**-10, dtype=torch.float16)).item() > 1.0


@pytest.mark.parametrize("alias,canon", [("half", "f16"), ("float16", "f16"), ("bfloat16", "bf16"), ("full", "f32"), ("torch.float32", "f32"), ("FP32", "f32")])
def test_aliases_resolve(alias, canon):
    assert get_format(alias).name == canon


def test_lookup_by_dtype_and_short_name():
    assert get_format(torch.bfloat16).name == "bf16" and short_name(torch.float16) == "f16"
    assert format_names()[:4] == ["f64", "f32", "bf16", "f16"]


def test_unknown_format_names_the_input_and_the_choices():
    with pytest.raises(ValueError, match="Unknown number format 'bf61'; expected one of .*bf16"):
        get_format("bf61")
    with pytest.raises(ValueError, match="not a floating-point format"):
        get_format(torch.int32)
    with pytest.raises(TypeError):
        get_format(3)
