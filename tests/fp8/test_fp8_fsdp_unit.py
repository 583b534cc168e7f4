"""fp8 all-gather's pieces on one process (the 2-rank runs are in test_fp8_distributed.py): the gathered
weight is fp8 bits with a scale that every other op reads as fp32, and the option is refused where it
cannot apply."""

from __future__ import annotations

import re

import pytest
import torch

from mixprec import MixedPrecision
from mixprec.fp8.casts import E4M3, amax, current_scale, dequantize_raw, quantize_raw
from mixprec.fp8.fsdp import Fp8GatheredWeight, Fp8ShardWeight, gathered, problem


def test_the_gathered_weight_is_its_bits_to_the_layer_and_fp32_to_everything_else():
    w = torch.randn(16, 32)
    s = current_scale(amax(w), E4M3)
    bits = quantize_raw(w, s, E4M3)
    g = Fp8GatheredWeight(bits, s, torch.float32)
    assert g.dtype == torch.float32 and g.shape == (16, 32)
    got_bits, got_s = gathered(g)
    assert torch.equal(got_bits.view(torch.uint8), bits.view(torch.uint8)) and got_s is s
    t = g.t()  # a view stays bits and scale (Conv1D's weight is seen transposed)
    assert isinstance(t, Fp8GatheredWeight) and torch.equal(gathered(t)[0].float(), bits.t().contiguous().float())
    assert torch.equal(g * 1.0, dequantize_raw(bits, s))  # any other op: the dequantized values
    assert gathered(w) is None


def test_the_shard_weight_is_an_fp32_tensor_to_the_optimizer_and_pickles_as_one():
    import io

    base = torch.randn(8, 4)
    p = torch.nn.Parameter(Fp8ShardWeight(base.clone(), E4M3, False))
    assert isinstance(p, Fp8ShardWeight) and p.requires_grad
    p.grad = torch.ones(8, 4)
    torch.optim.SGD([p], lr=0.5).step()
    assert torch.equal(p._tensor, base - 0.5)  # stepped in place, as fp32
    buf = io.BytesIO()
    torch.save(p, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)  # a plain fp32 tensor: a checkpoint needs no mixprec to load
    assert type(loaded) in (torch.Tensor, torch.nn.Parameter) and torch.equal(loaded, base - 0.5)


@pytest.mark.parametrize("recipe, options, match", [
    ("bf16-mixed", None, "needs an fp8 recipe"),
    ("fp8-delayed", None, "needs current tensorwise scaling .* scales delayed tensorwise"),
    ("fp8", {"granularity": "rowwise"}, "scales current rowwise"),
    ("fp8", {"granularity": "mx", "format": "e4m3"}, "scales current mx"),
])
def test_fp8_all_gather_is_refused_where_it_cannot_apply(recipe, options, match):
    from fp8_helpers import tiny_gpt
    from mixprec.distributed import FSDP
    from mixprec.distributed.prepare import local_problems

    from mixprec.seam import Local

    mp = MixedPrecision(recipe, "cpu", fp8=options)
    local = Local(mp.recipe, mp.device, mp.scaler, mp.accumulate, mp.fp32_modules, mp.masters, mp._prepare, False,
                  mp.fp8_spec)  # what prepare(parallel=...) hands the strategy (the seam)
    found = local_problems(local, tiny_gpt(), FSDP(fp8_all_gather=True))
    assert len(found) == 1 and re.search(match, found[0]), found  # one reason, said before any collective
    assert problem(MixedPrecision("fp8-current", "cpu").fp8_spec) is None
