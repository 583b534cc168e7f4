"""The fp8 recipes, the module swap in prepare, its rules as describe() shows them, remove_fp8, bad input."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import mixprec
from fp8_helpers import tiny_gpt
from mixprec import MixedPrecision
from mixprec.fp8 import Fp8Linear, Fp8Warning, fp8_layers, remove_fp8
from mixprec.recipes import Fp8Spec, get_recipe, resolve_recipe


def test_recipes_are_bf16_mixed_with_an_fp8_spec_and_fp8_means_current_scaling():
    base = get_recipe("bf16-mixed")
    for name, scaling in (("fp8-current", "current"), ("fp8-delayed", "delayed"), ("fp8-unscaled", "none")):
        r = get_recipe(name)
        assert (r.policy, r.autocast, r.fp32_modules, r.loss_scaling, r.master) == (
            base.policy, base.autocast, base.fp32_modules, "none", "none")
        assert r.fp8.scaling == scaling
    assert get_recipe("fp8") is get_recipe("fp8-current")  # the recommended one (torchao's choice)
    d = get_recipe("fp8-delayed").fp8
    assert (d.format, d.amax_history_len, d.amax_compute_algo, d.margin) == ("hybrid", 1024, "max", 0)  # TE's defaults
    assert get_recipe("fp8-unscaled").fp8.format == "e4m3" and "UNSAFE" in get_recipe("fp8-unscaled").description
    assert resolve_recipe("fp8", "cpu").name == "fp8-current"


@pytest.mark.parametrize("options, match", [
    ({"format": "e5m2"}, "format='e5m2'; expected one of hybrid, e4m3"),
    ({"amax_history_len": 0}, "amax_history_len must be an integer >= 1, got 0"),
    ({"margin": -1}, "margin must be an integer >= 0"),
    ({"scaling": "sometimes"}, "scaling='sometimes'"),
    ({"granularity": "rowwise", "scaling": "delayed"}, "rowwise scaling needs scaling='current'"),
    ({"history": 4}, r"unknown fp8 option\(s\) \['history'\]; expected some of scaling, format"),
])
def test_bad_fp8_options_are_refused_with_what_is_allowed(options, match):
    with pytest.raises(ValueError, match=match):
        MixedPrecision("fp8-delayed", "cpu", fp8=options)


def test_fp8_options_on_a_recipe_without_fp8_are_refused():
    with pytest.raises(ValueError, match="fp8= applies to fp8 recipes"):
        MixedPrecision("bf16-mixed", "cpu", fp8={"margin": 1})
    with pytest.raises(TypeError, match="exclude must be a tuple of glob patterns"):
        Fp8Spec(exclude="blocks.*")


def test_describe_lists_every_linear_with_its_decision_and_rule():
    model = tiny_gpt()
    model.blocks[0].mha = nn.MultiheadAttention(32, 2)  # out_proj: a Linear subclass that never calls forward
    model.blocks[1].odd = nn.Linear(32, 20)
    mp = MixedPrecision("fp8-delayed", "cpu", fp8={"exclude": ("blocks.1.fc",)}, fp32_modules=["blocks.1.proj"])
    text_before = mp.describe()
    assert "delayed scaling, amax history 1024 (max), margin 0" in text_before and "prepare a model" in text_before
    mp.prepare(model)
    text = mp.describe()
    rows = {ln.split()[0]: ln for ln in text.splitlines()[6:]}
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert set(rows) == set(linears)  # every one of them, none left out
    assert "first nn.Linear" in rows["blocks.0.qkv"] and "bf16" in rows["blocks.0.qkv"]
    assert "excluded by 'blocks.1.fc'" in rows["blocks.1.fc"]
    assert "fp32 island" in rows["blocks.1.proj"] and " fp32 " in rows["blocks.1.proj"]
    assert "NonDynamicallyQuantizableLinear is a subclass" in rows["blocks.0.mha.out_proj"]
    assert "32x20: fp8 GEMMs need both dims multiples of 16" in rows["blocks.1.odd"]
    assert "last nn.Linear" in rows["head"]
    fp8 = {n for n, _ in fp8_layers(model)}
    assert fp8 == {"blocks.0.proj", "blocks.0.fc", "blocks.0.out", "blocks.1.qkv", "blocks.1.out"}
    assert all(" fp8" in rows[n] for n in fp8)
    assert "5 of 11 nn.Linear in fp8" in text and "emulated GEMMs (fp32)" in text


def test_an_lm_head_tied_to_the_embedding_stays_bf16():
    model = tiny_gpt()
    model.head.weight = model.tok.weight  # tied
    model.extra = nn.Linear(96, 96)  # now the last linear; the head is still the LM head
    mp = MixedPrecision("fp8-current", "cpu")
    mp.prepare(model)
    assert "LM head" in next(ln for ln in mp.describe().splitlines() if ln.split()[0:1] == ["head"])


def test_a_model_with_no_eligible_linear_warns_and_trains_as_bf16_mixed():
    model = nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 3))
    mp = MixedPrecision("fp8-current", "cpu")
    with pytest.warns(Fp8Warning, match="no layer of this model computes in fp8 .*0: 10x20: fp8 GEMMs need"):
        mp.prepare(model)
    assert mp.fp8.layers == [] and not any(isinstance(m, Fp8Linear) for m in model.modules())


def test_the_swap_keeps_parameters_hooks_and_state_dict_keys_and_remove_fp8_undoes_it():
    model = tiny_gpt()
    keys = list(model.state_dict())
    params = {n: p for n, p in model.named_parameters()}
    seen = []
    model.blocks[0].fc.register_forward_hook(lambda m, a, o: seen.append(type(m).__name__))
    mp = MixedPrecision("fp8-delayed", "cpu")
    mp.prepare(model)
    assert list(model.state_dict()) == keys  # the fp8 buffers are not part of the model's state dict
    assert all(p is params[n] for n, p in model.named_parameters())  # an optimizer built before still steps them
    with mp.autocast():
        model(torch.randint(0, 96, (2, 16)))
    assert seen == ["Fp8Linear"]
    assert mixprec.remove_fp8 is remove_fp8
    remove_fp8(model)
    assert not fp8_layers(model) and type(model.blocks[0].fc) is nn.Linear
    assert not any("fp8" in n for n, _ in model.named_buffers()) and "fp8_config" not in vars(model.blocks[0].fc)
    assert all(p is params[n] for n, p in model.named_parameters())
    out = model(torch.randint(0, 96, (2, 16)))
    assert out.dtype == torch.float32


def test_auto_gemm_is_the_emulation_on_cpu_and_scaled_mm_can_be_asked_for():
    model = tiny_gpt(d_model=16, n_layer=1)
    mp = MixedPrecision("fp8-current", "cpu", fp8={"gemm": "scaled_mm"})
    mp.prepare(model)
    assert mp.fp8.backend == "scaled_mm" and "torch._scaled_mm" in mp.describe()
    assert MixedPrecision("fp8", "cpu").prepare(tiny_gpt()).blocks[1].fc.fp8_config.backend == "emulate"


def test_the_recipes_listing_shows_the_fp8_recipes(capsys):
    from mixprec.cli import main

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    for name in ("fp8-current", "fp8-delayed", "fp8-unscaled"):
        assert name in out
