"""What needs no second rank: the options, the errors before any collective, which modules FSDP2
gathers in 16 bits, and that one process never loads mixprec.distributed."""

import subprocess
import sys

import pytest
import torch
from torch import nn

import mixprec
from mixprec.distributed import DDP, FSDP, as_parallel
from mixprec.distributed.fsdp import fp32_modules, units, unsupported
from mixprec.recipes import get_recipe
from mixprec.tasks import charlm
from mixprec_test_env import src_env


def test_parallel_names_and_configs():
    assert as_parallel("ddp") == DDP() and as_parallel(" FSDP ") == FSDP()
    assert FSDP(reduce_dtype="bf16").wire_dtype == torch.bfloat16 and DDP().wire_dtype == torch.float32
    with pytest.raises(ValueError, match="'ddp', 'fsdp', mixprec.distributed.DDP"):
        as_parallel("zero3")
    with pytest.raises(ValueError, match="fp32, bf16, fp16"):
        DDP(compress="int8")
    with pytest.raises(TypeError, match="list of module names"):
        FSDP(units="Block")


@pytest.mark.parametrize("make, message", [
    # found by qa: each was accepted; "no" is truthy, so FSDP(fp8_all_gather="no") gathered in fp8 and
    # reshard_after_forward="no" resharded
    (lambda: FSDP(fp8_all_gather="no"), "FSDP(fp8_all_gather=...) is True or False, got 'no'"),
    (lambda: FSDP(fp8_all_gather=1), "FSDP(fp8_all_gather=...) is True or False, got 1"),
    (lambda: FSDP(reshard_after_forward="no"), "FSDP(reshard_after_forward=...) is True or False"),
    (lambda: DDP(find_unused_parameters="yes"), "DDP(find_unused_parameters=...) is True or False, got 'yes'"),
    (lambda: DDP(broadcast_buffers=None), "DDP(broadcast_buffers=...) is True or False, got None"),
    (lambda: DDP(gradient_as_bucket_view=0), "DDP(gradient_as_bucket_view=...) is True or False, got 0"),
    (lambda: DDP(bucket_cap_mb=0), "DDP(bucket_cap_mb=...) is a positive number of megabytes or None, got 0"),
    (lambda: DDP(bucket_cap_mb="25"), "DDP(bucket_cap_mb=...) is a positive number of megabytes or None, got '25'"),
    (lambda: FSDP(mesh=3), "FSDP(mesh=...) is a torch.distributed.device_mesh.DeviceMesh (init_device_mesh) or None, got int"),
])
def test_options_of_the_wrong_type_are_refused_not_read_as_truthy(make, message):
    import re

    with pytest.raises((TypeError, ValueError), match=re.escape(message)):
        make()
    assert FSDP(reshard_after_forward=False).reshard_after_forward is False and DDP(bucket_cap_mb=25).bucket_cap_mb == 25


def test_prepare_without_a_process_group_says_how_to_make_one():
    mp = mixprec.MixedPrecision("bf16-mixed", "cpu")
    with pytest.raises(ValueError, match="init_process_group.*torchrun.*drop parallel="):
        mp.prepare(nn.Linear(2, 2), parallel="fsdp")
    with pytest.raises(ValueError, match="parallel='zero'"):
        mp.prepare(nn.Linear(2, 2), parallel="zero")


def test_fsdp_refuses_the_recipes_without_an_fp32_master_and_says_what_to_use():
    assert unsupported(get_recipe("bf16-mixed")) is None and unsupported(get_recipe("fp16-true")) is None
    for name in ("bf16-true-kahan", "bf16-true-sr", "bf16-true-remainder", "bf16-pure", "fp16-pure"):
        assert "bf16-true" in unsupported(get_recipe(name)), name


class Scaled(nn.Module):
    """A module with its own parameter used in an elementwise op (not autocast)."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(4))
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) * self.gain


def test_fsdp_gathers_in_16_bits_exactly_what_one_process_computes_in_16_bits():
    model = charlm.make_task(d_model=16, n_head=2).build_model()
    mp = mixprec.MixedPrecision("bf16-mixed", "cpu")
    mp.prepare(model)  # the islands (norms), as prepare(parallel=) makes them before sharding
    expected = {"tok", "pos", "ln_f", "blocks.0.ln1", "blocks.0.ln2", "blocks.1.ln1", "blocks.1.ln2"}
    assert fp32_modules(model, get_recipe("bf16-mixed"), ()) == expected
    assert units(model, None) == ["blocks.0", "blocks.1"]
    # a module's own parameter in an elementwise op: fp32 under a mixed recipe (autocast leaves it
    # alone), 16-bit under a storage recipe (one process stores it in 16 bits) unless the rule keeps it
    net = nn.Sequential(Scaled(), nn.LayerNorm(4))
    mixprec.MixedPrecision("bf16-mixed", "cpu").prepare(net)
    assert fp32_modules(net, get_recipe("bf16-mixed"), ()) == {"0", "1"}
    net = nn.Sequential(Scaled(), nn.LayerNorm(4))
    mixprec.MixedPrecision("bf16-true", "cpu").prepare(net)
    assert fp32_modules(net, get_recipe("bf16-true"), ("norms", "biases")) == {"1"}
    assert fp32_modules(net, get_recipe("bf16-true"), ("norms", "0.gain")) == {"0", "1"}


def test_fsdp_shards_every_unit_as_an_fp32_group_and_a_compute_group(match_run):
    groups = match_run[0]["match"]["groups/bf16-mixed"]
    assert groups == [["blocks.0", "fp32"], ["blocks.0", "compute"], ["blocks.1", "fp32"], ["blocks.1", "compute"],
                      ["", "fp32"], ["", "compute"]]
    assert match_run[0]["match"]["groups/fp32"] == [["blocks.0", "compute"], ["blocks.1", "compute"], ["", "compute"]]


def test_units_can_be_named_and_a_typo_is_refused():
    model = charlm.make_task(d_model=16, n_head=2).build_model()
    assert units(model, ["Block"]) == ["blocks.0", "blocks.1"]
    assert units(model, ["blocks.1.fc", "head"]) == ["blocks.1.fc", "head"]
    with pytest.raises(ValueError, match="'blokcs' matches no submodule"):
        units(model, ["blokcs"])


def test_one_process_never_loads_mixprec_distributed():
    code = (
        "import sys, torch, mixprec\n"
        "mp = mixprec.MixedPrecision('fp16-mixed', 'cpu')\n"
        "m = mp.prepare(torch.nn.Linear(4, 4))\n"
        "opt = torch.optim.SGD(mp.parameters(m), lr=0.1)\n"
        "with mp.autocast():\n    y = m(torch.randn(2, 4))\n"
        "mp.step(y.float().pow(2).mean(), opt, max_grad_norm=1.0)\n"
        "print(sorted(k for k in sys.modules if k.startswith('mixprec.distributed')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=src_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_an_across_reduction_makes_the_skip_decision_even_with_one_optimizer():
    """The seam the ranks share their flag through: here a stand-in that says another rank overflowed."""
    w = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = mixprec.GradScaler("cpu", init_scale=4.0)
    scaler.scale((w * 2).sum()).backward()
    scaler.unscale_(opt)
    calls = []
    scaler.share_skip_decision([opt], across=lambda found: (calls.append(float(found)), found.fill_(1.0)))
    scaler.step(opt)
    scaler.update()
    assert calls == [0.0] and scaler.was_skipped() and scaler.get_scale() == 2.0
    assert torch.equal(w.detach(), torch.ones(3))
