"""A model prepared for a 16-bit storage recipe runs outside mp.autocast() too (evaluation loops and
generate() are written without it), computing exactly what it computes inside."""

from __future__ import annotations

import inspect

import pytest
import torch
from masters_helpers import STORAGE_RECIPES, tiny_gpt

from mixprec import MixedPrecision


@pytest.mark.parametrize("recipe", [*STORAGE_RECIPES, "fp16-pure"])
def test_eval_outside_autocast_equals_eval_inside(recipe):
    mp = MixedPrecision(recipe, "cpu")
    model = mp.prepare(tiny_gpt()).eval()
    x = torch.randint(0, 96, (2, 16))
    with torch.no_grad():
        outside = model(x)  # was: "self and mat2 must have the same dtype"
        with mp.autocast():
            inside = model(x)
    assert outside.dtype == torch.float32 and torch.equal(outside, inside)
    assert not torch.is_autocast_enabled("cpu")  # nothing leaked out of the forward


def test_a_generate_loop_written_without_autocast_runs():
    mp = MixedPrecision("bf16-true", "cpu")
    model = mp.prepare(tiny_gpt()).eval()
    ids = torch.zeros(1, 1, dtype=torch.long)
    with torch.no_grad():
        for _ in range(5):  # greedy decoding, as generate() does it
            ids = torch.cat([ids, model(ids)[:, -1:].argmax(-1)], dim=1)
    assert ids.shape == (1, 6)


def test_the_wrapped_forward_keeps_the_models_signature_and_training_is_unchanged():
    mp = MixedPrecision("bf16-true", "cpu")
    model = mp.prepare(tiny_gpt())
    assert list(inspect.signature(model.forward).parameters) == ["idx"]
    ref_mp = MixedPrecision("bf16-true", "cpu")
    ref = ref_mp.prepare(tiny_gpt())
    ref.forward = type(ref).forward.__get__(ref)  # without the wrapper: the old behaviour inside autocast
    x = torch.randint(0, 96, (2, 16))
    with mp.autocast():
        a = model(x)
    with ref_mp.autocast():
        b = ref(x)
    assert torch.equal(a, b)


@pytest.mark.parametrize("recipe", ["bf16-true", "fp16-true", "bf16-true-remainder", "bf16-true-kahan"])
def test_an_fp32_export_holds_the_masters_and_loads_into_a_plain_fp32_model(recipe):
    from masters_helpers import train

    mp = MixedPrecision(recipe, "cpu", **({} if recipe == "fp16-true" else {"skip_nonfinite": True}))
    model = mp.prepare(tiny_gpt())
    opt = torch.optim.AdamW(mp.parameters(model), lr=3e-3)
    train(model, mp, opt, range(2))
    export = mp.fp32_state_dict(model)
    assert {v.dtype for v in export.values() if v.is_floating_point()} == {torch.float32}
    masters = mp.masters.masters()
    assert all(torch.equal(export[n], m) for n, m in masters.items())
    plain = tiny_gpt(seed=9)
    plain.load_state_dict(export)  # an fp32 model of the same class takes it as is (save_pretrained's state_dict=)
    assert torch.equal(dict(plain.named_parameters())["head.weight"], masters["head.weight"])
