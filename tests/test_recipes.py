"""Recipe names, aliases, jmp strings, 'auto' and what a device can run."""

import dataclasses

import pytest
import torch

import mixprec
from mixprec import recipes
from mixprec.recipes import Recipe, get_recipe, resolve_recipe


@pytest.mark.parametrize(
    "name,canon",
    [("fp32", "fp32"), ("32-true", "fp32"), ("O0", "fp32"), ("bf16-mixed", "bf16-mixed"), ("BF16", "bf16-mixed"),
     ("16-mixed", "fp16-mixed"), ("fp16-mixed", "fp16-mixed"), ("O1", "fp16-mixed"), ("16", "fp16-mixed"),
     ("fp16", "fp16-mixed")],
)
def test_names_and_aliases(name, canon):
    assert resolve_recipe(name, "cpu").name == canon


def test_recipes_carry_more_than_a_dtype():
    fp16 = get_recipe("fp16-mixed")
    assert (fp16.loss_scaling, fp16.autocast, fp16.fp32_modules) == ("dynamic", True, ("norms",))
    bf16 = get_recipe("bf16-mixed")
    assert (bf16.loss_scaling, str(bf16.policy)) == ("none", "p=f32,c=bf16,o=f32")
    assert not get_recipe("fp32").autocast and not get_recipe("fp32").is_mixed and bf16.is_mixed


@pytest.mark.parametrize("text,scaling,compute", [("p=f32,c=bf16,o=f32", "none", torch.bfloat16), ("c=f16,o=f32", "dynamic", torch.float16), ("f32", "none", torch.float32)])
def test_jmp_policy_strings_become_recipes(text, scaling, compute):
    r = resolve_recipe(text, "cpu")
    assert r.loss_scaling == scaling and r.compute_dtype == compute and r.autocast == (compute != torch.float32)


def test_unknown_recipe_lists_what_is_accepted():
    with pytest.raises(ValueError, match=r"Unknown recipe 'bf16-mixd'. Did you mean 'bf16-mixed'\? Expected one of auto, fp32, bf16-mixed, fp16-mixed.*mixprec recipes"):
        resolve_recipe("bf16-mixd", "cpu")
    with pytest.raises(ValueError, match="Unknown dtype 'bf61'"):
        resolve_recipe("p=f32,c=bf61", "cpu")


def test_get_recipe_says_what_it_takes():
    with pytest.raises(TypeError, match="expected a recipe name, got int"):
        get_recipe(16)
    for name in ("auto", "p=f32,c=bf16,o=f32"):  # the unknown-recipe message would list them as accepted
        with pytest.raises(ValueError, match=r"registered recipes only; resolve_recipe\("):
            get_recipe(name)
    with pytest.raises(ValueError, match="Unknown recipe 'bf16-mixd'"):
        get_recipe("bf16-mixd")


def test_unknown_device_is_a_clear_error():
    with pytest.raises(ValueError, match="Unknown device 'gpu0'"):
        resolve_recipe("fp32", "gpu0")


def _measured(monkeypatch, bf16_s, fp32_s):
    from mixprec import autotune

    monkeypatch.setattr(autotune, "_MEMO", {})
    monkeypatch.setenv(autotune.ENV_MODE, "refresh")  # (test_autotune.py covers the cache)
    monkeypatch.setattr(autotune, "MEASURE", {**autotune.MEASURE, "compute": lambda d: {"bf16_s": bf16_s, "fp32_s": fp32_s}})


def test_auto_on_cpu_where_bf16_is_measured_slower_picks_fp32_and_says_why(monkeypatch):
    monkeypatch.setattr(recipes, "cpu_bf16_support", lambda: (False, "this CPU has neither AVX512-BF16 nor AMX"))
    _measured(monkeypatch, bf16_s=3.0, fp32_s=1.0)  # emulated bf16: slower
    r = resolve_recipe("auto", "cpu")
    assert r.name == "fp32" and "neither AVX512-BF16 nor AMX" in r.reason and r.reason.startswith("auto:")
    assert "bf16 autocast measured 0.33x as fast as fp32" in r.reason


def test_auto_on_cpu_where_bf16_is_measured_faster_picks_bf16_with_the_fastest_attention(monkeypatch):
    monkeypatch.setattr(recipes, "cpu_bf16_support", lambda: (True, "this CPU has AMX"))
    _measured(monkeypatch, bf16_s=1.0, fp32_s=2.5)
    r = resolve_recipe("auto", "cpu")
    assert r.name == "bf16-mixed" and "AMX" in r.reason and "2.50x" in r.reason and r.attention == "fastest"


def test_auto_reflects_this_machine():
    from mixprec import autotune

    ok, found = recipes.cpu_bf16_support()
    choice = autotune.compute_choice(torch.device("cpu"))  # measured (or cached) here
    assert resolve_recipe("auto", "cpu").name == choice[0]
    assert "CPU" in found


@pytest.mark.parametrize("bf16,expected", [(True, "bf16-mixed"), (False, "fp16-mixed")])
def test_auto_on_cuda_picks_by_native_bf16(monkeypatch, bf16, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (9, 0) if bf16 else (7, 5))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16)
    r = recipes._auto(torch.device("cuda"))
    assert r.name == expected and "Fake GPU" in r.reason


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_recipe_on_missing_cuda_says_what_to_do():
    with pytest.raises(RuntimeError, match="CUDA is not available.*Use device='cpu'"):
        resolve_recipe("bf16-mixed", "cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"], ids=["no-index", "index-1"])  # an id "cuda" would skip it (conftest)
def test_auto_on_missing_cuda_says_what_to_do(device):
    with pytest.raises(RuntimeError, match="'auto' was asked for device 'cuda.*CUDA is not available.*Use device='cpu'"):
        resolve_recipe("auto", device)


def test_register_recipe_adds_names_and_refuses_duplicates():
    r = Recipe("test-recipe-x", mixprec.get_policy("p=f32,c=bf16,o=f32"), autocast=True)
    try:
        recipes.register_recipe(r, aliases=("trx",))
        assert resolve_recipe("TRX", "cpu") is r
        with pytest.raises(ValueError, match="already registered"):
            recipes.register_recipe(r)
        with pytest.raises(ValueError, match="already registered"):
            recipes.register_recipe(dataclasses.replace(r, name="auto"))
    finally:
        for k in ("test-recipe-x", "trx"):
            recipes._ALIASES.pop(k, None)
        recipes._REGISTRY.pop("test-recipe-x", None)
        recipes._DISPLAY_ALIASES.pop("test-recipe-x", None)


def test_bad_loss_scaling_kind_is_rejected():
    with pytest.raises(ValueError, match="expected 'none', 'static' or 'dynamic'"):
        Recipe("x", mixprec.get_policy("f32"), loss_scaling="sometimes")  # type: ignore[arg-type]
