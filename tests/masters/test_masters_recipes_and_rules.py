"""The 16-bit storage recipes in the registry, and the rule for parameters that stay fp32."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from mixprec import MixedPrecision
from mixprec.masters import fp32_param_names
from mixprec.recipes import FP32_PARAMS, Policy, Recipe, get_recipe, resolve_recipe


@pytest.mark.parametrize(
    "name, dtype, master, scaling",
    [
        ("bf16-true", torch.bfloat16, "fp32", "none"),
        ("fp16-true", torch.float16, "fp32", "dynamic"),
        ("O2", torch.float16, "fp32", "dynamic"),
        ("bf16-true-kahan", torch.bfloat16, "kahan", "none"),
        ("bf16-true-sr", torch.bfloat16, "sr", "none"),
        ("bf16-true-remainder", torch.bfloat16, "remainder", "none"),
        ("bf16-pure", torch.bfloat16, "nearest", "none"),
    ],
)
def test_storage_recipes_store_16bit_with_their_master_kind(name, dtype, master, scaling):
    r = get_recipe(name)
    assert r.policy.param_dtype == dtype and r.policy.compute_dtype == dtype
    assert r.policy.output_dtype == torch.float32  # the loss is computed in fp32
    assert (r.master, r.loss_scaling, r.stores_16bit, r.autocast) == (master, scaling, True, True)
    assert r.fp32_params == FP32_PARAMS


def test_bf16_pure_says_it_is_unsafe():
    assert get_recipe("bf16-pure").description.startswith("UNSAFE")


def test_o3_is_apex_pure_fp16():
    # REFERENCE: "O3 pure fp16" - fp16 model, no master weights, batchnorm in fp16, loss scale 1
    r = get_recipe("O3")
    assert r.name == "fp16-pure" and r.description.startswith("UNSAFE")
    assert (r.master, r.loss_scaling, r.fp32_params, r.fp32_modules) == ("nearest", "none", (), ())
    assert r.policy.param_dtype == r.policy.compute_dtype == torch.float16
    assert r.pure
    mp = MixedPrecision("O3", "cpu")
    torch.manual_seed(0)  # (the input below was drawn from an unseeded generator: another each run)
    model = mp.prepare(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.LayerNorm(4)))
    assert {p.dtype for p in model.parameters()} == {torch.float16}  # norms and biases too
    assert model[1].running_var.dtype == torch.float16  # buffers too, as model.half() does
    assert mp.masters.kind == "nearest" and mp.scaler.__class__.__name__ == "NoOpScaler"
    opt = torch.optim.SGD(mp.parameters(model), lr=0.1)
    seen = []
    model[0].register_forward_pre_hook(lambda m, a: seen.append(a[0].dtype))
    before = model[0].weight.detach().clone()
    with mp.autocast():
        out = model(torch.randn(8, 4))  # an fp32 input: cast to fp16 on the way in
    # weighted: mean(out**2) of a LayerNorm's output is ~1 whatever the weights, so its gradient is
    # ~0 and an fp16 weight may keep its value; this loss moves the weights by ~1e-2
    mp.step((out * torch.arange(4.0)).mean(), opt)
    assert seen == [torch.float16] and out.dtype == torch.float32
    assert not torch.equal(model[0].weight, before) and model[0].weight.dtype == torch.float16


def test_pure_needs_16_bit_parameters_and_no_fp32_rule():
    with pytest.raises(ValueError, match="pure=True"):
        Recipe("x", Policy(torch.float32, torch.float16, torch.float32), pure=True)
    with pytest.raises(ValueError, match="pure=True"):
        Recipe("x", Policy(torch.float16, torch.float16, torch.float32), master="nearest", fp32_params=FP32_PARAMS,
               pure=True)


def test_mixed_recipes_keep_fp32_storage_and_no_master():
    for name in ("fp32", "bf16-mixed", "fp16-mixed"):
        r = get_recipe(name)
        assert r.master == "none" and not r.stores_16bit and r.policy.param_dtype == torch.float32


@pytest.mark.parametrize("text, dtype", [("p=bf16,c=bf16,o=f32", torch.bfloat16), ("p=f16,c=f16,o=f32", torch.float16)])
def test_policy_string_with_16bit_params_resolves_to_fp32_masters(text, dtype):
    r = resolve_recipe(text, "cpu")
    assert r.name == text and r.master == "fp32" and r.policy.param_dtype == dtype
    assert r.loss_scaling == ("dynamic" if dtype == torch.float16 else "none")


def test_policy_string_keeps_its_output_dtype():
    assert resolve_recipe("p=bf16", "cpu").policy.output_dtype == torch.bfloat16


@pytest.mark.parametrize("text", ["p=bf16,c=f32", "p=f16,c=bf16", "p=bf16,c=f16,o=f32"])
def test_policy_string_with_storage_and_compute_apart_is_refused(text):
    with pytest.raises(ValueError, match="p=bf16,c=bf16 or p=f16,c=f16"):
        resolve_recipe(text, "cpu")


def test_recipe_storing_16bit_without_master_is_refused():
    with pytest.raises(ValueError, match="small updates would vanish"):
        Recipe("half", Policy(torch.float16, torch.float16, torch.float32), autocast=True)


def test_recipe_with_fp32_storage_and_a_master_is_refused():
    with pytest.raises(ValueError, match="has nothing to do"):
        dataclasses.replace(get_recipe("bf16-mixed"), master="fp32")


@pytest.mark.parametrize("master", ["sr", "remainder"])
def test_bit_trick_masters_need_bf16_storage(master):
    with pytest.raises(ValueError, match="works on bf16 storage"):
        dataclasses.replace(get_recipe("fp16-true"), master=master)


def test_unknown_master_kind_lists_the_known_ones():
    with pytest.raises(ValueError, match="fp32, kahan, sr, remainder, nearest"):
        dataclasses.replace(get_recipe("bf16-true"), master="fp64")


# ---------------------------------------------------------------- fp32 parameter rule


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(10, 8)
        self.ln = nn.LayerNorm(8)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8, bias=False))
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.tok.weight  # tied


def test_default_rule_keeps_norms_biases_and_embeddings_fp32():
    assert fp32_param_names(Net(), FP32_PARAMS) == ["tok.weight", "ln.weight", "ln.bias", "body.0.bias"]


def test_rule_accepts_names_modules_classes_and_predicates():
    net = Net()
    assert fp32_param_names(net, ["body.0.weight"]) == ["body.0.weight"]
    assert fp32_param_names(net, ["body"]) == ["body.0.weight", "body.0.bias", "body.2.weight"]
    assert fp32_param_names(net, ["LayerNorm"]) == ["ln.weight", "ln.bias"]
    assert fp32_param_names(net, [nn.LayerNorm]) == ["ln.weight", "ln.bias"]
    assert fp32_param_names(net, [lambda name, p: p.ndim == 1]) == ["ln.weight", "ln.bias", "body.0.bias"]


def test_tied_parameter_stays_fp32_when_any_owner_matches():
    assert fp32_param_names(Net(), ["head"]) == ["tok.weight"]  # head.weight *is* tok.weight


def test_rule_naming_nothing_raises_instead_of_storing_in_16bit():
    with pytest.raises(ValueError, match="'bodyy' matches no parameter"):
        fp32_param_names(Net(), ["bodyy"])


def test_user_rule_replaces_the_recipe_rule_and_shows_in_describe():
    mp = MixedPrecision("bf16-true", "cpu", fp32_params=["ln"])
    model = mp.prepare(Net())
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert dtypes["ln.weight"] == torch.float32 and dtypes["body.0.bias"] == torch.bfloat16
    assert dtypes["tok.weight"] == torch.bfloat16
    assert "fp32: ln (2) (2 tensors)" in mp.describe()  # per rule item, then the total


def test_fp32_params_on_a_recipe_storing_fp32_is_refused():
    with pytest.raises(ValueError, match="Use fp32_modules="):
        MixedPrecision("bf16-mixed", "cpu", fp32_params=["ln"])
