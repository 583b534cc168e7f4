"""fp8 as a user meets it: real model shapes, the layers a report calls fp8 really computing in fp8,
empty batches, bad inputs, a weight written through ``.data``, and checkpoints that must be refused."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fp8_helpers import build, fp8_linear, tiny_gpt, train
from mixprec import MixedPrecision
from mixprec.fp8 import fp8_layers
from mixprec.fp8.casts import E4M3, amax, current_scale, quantize_raw
from mixprec.fp8.swap import candidates


def _fp8_emulated(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """What an fp8-current tensorwise layer computes under bf16 autocast, written out: e4m3 operands
    with current scales, an fp32 product, rounded to bf16, plus the bias."""
    x = x.to(torch.bfloat16)
    x2 = x.reshape(-1, x.shape[-1])
    sx, sw = current_scale(amax(x2), E4M3), current_scale(amax(w), E4M3)
    out = torch.mm(quantize_raw(x2, sx, E4M3).float() / sx, (quantize_raw(w, sw, E4M3).float() / sw).t())
    out = out.to(torch.bfloat16).reshape(*x.shape[:-1], w.shape[0])
    return out if b is None else out + b.to(torch.bfloat16)


def test_every_layer_llama_reports_in_fp8_computes_from_fp8_operands_and_the_rest_in_bf16():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                   vocab_size=100)  # the LM head (64 x 100) is not a multiple of 16
    model = transformers.LlamaForCausalLM(cfg)
    mp = MixedPrecision("fp8-current", "cpu")
    mp.prepare(model)
    decided = {d.name: d.precision for d in mp.fp8.decisions}
    assert decided["lm_head"] == "bf16" and decided["model.layers.0.self_attn.q_proj"] == "bf16"  # first, not /16
    assert sum(p == "fp8" for p in decided.values()) == 13
    seen = {}

    def hook(name):
        def check(mod, args, out):
            with torch.autocast("cpu", enabled=False), torch.no_grad():
                x, b = args[0], None if mod.bias is None else mod.bias
                if decided[name] == "fp8":
                    want = _fp8_emulated(x, mod.weight, b)
                else:
                    want = F.linear(x.to(torch.bfloat16), mod.weight.to(torch.bfloat16),
                                    None if b is None else b.to(torch.bfloat16))
            seen[name] = out.dtype == want.dtype and torch.equal(out.detach(), want)
        return check

    hooks = [m.register_forward_hook(hook(n)) for n, m in candidates(model)]
    with mp.autocast():
        model(input_ids=torch.randint(0, 100, (2, 8)))
    for h in hooks:
        h.remove()
    assert seen == {n: True for n in decided}  # every layer called, each computing what the report says


@pytest.mark.parametrize("spec", [{}, {"scaling": "delayed"}, {"granularity": "rowwise"}, {"scaling": "none"},
                                  {"granularity": "mx", "format": "e4m3"}],
                         ids=["current", "delayed", "rowwise", "unscaled", "mx"])
def test_a_batch_of_no_tokens_goes_through_as_through_nn_linear(spec):
    # an MoE expert that got no tokens: torch's amax refused to reduce over nothing
    lin = fp8_linear(64, 32, history=4, **spec)
    x = torch.randn(0, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x)
    y.float().sum().backward()
    assert y.shape == (0, 32) and x.grad.shape == (0, 64)
    assert torch.equal(lin.weight.grad, torch.zeros_like(lin.weight))
    if spec.get("scaling") == "delayed":  # nothing cast: the input's and the gradient's slots stay 0
        assert lin.fp8_amax_history[0, 0] == 0 and lin.fp8_amax_history[0, 2] == 0


@pytest.mark.parametrize("spec", [{}, {"granularity": "mx", "format": "e4m3"}], ids=["tensorwise", "mx"])
def test_an_input_nn_linear_refuses_is_refused_naming_the_layer(spec):
    lin = fp8_linear(64, 32, **spec)
    with pytest.raises(TypeError, match="fp8 layer 'lin': the input is torch.int64; an fp8 matmul takes a floating"):
        lin(torch.ones(4, 64, dtype=torch.long))  # computed as x.float() * s and returned as integers before
    with pytest.raises(ValueError, match=r"fp8 layer 'lin': the input has 63 features .* the layer takes 64 features"):
        lin(torch.randn(4, 63))  # MXFP8 said only "a multiple of 32"


def test_a_training_forward_after_an_eval_loop_on_weights_swapped_in_through_data_casts_the_live_weights():
    model, mp, opt = build("fp8-current")
    train(model, mp, opt, range(2))
    live = [p.detach().clone() for p in model.parameters()]
    x = torch.randint(0, 96, (4, 16))
    model.eval()  # an EMA evaluation, its weights swapped in and out through .data (no version bump)
    for p in model.parameters():
        p.data.mul_(0.5)
    with torch.no_grad(), mp.autocast():
        model(x)
    for p, q in zip(model.parameters(), live):
        p.data.copy_(q)
    model.train()
    with mp.autocast():
        got = model(x)
    twin = copy.deepcopy(model)  # (copies hold no cached cast)
    with mp.autocast():
        want = twin(x)
    assert torch.equal(got, want)  # the EMA weights' cached cast was reused before


def _delayed_state():
    model, mp, opt = build("fp8-delayed", fp8={"amax_history_len": 4})
    train(model, mp, opt, range(2))
    return model, mp, copy.deepcopy(mp.state_dict())


@pytest.mark.parametrize("damage, match", [
    (lambda e: e.update(scale=torch.full((3,), 1e300, dtype=torch.float64)),
     r"scale \[inf, inf, inf\] \(as the layer's torch.float32 holds it; saved as torch.float64\) is not finite"),
    (lambda e: e.update(amax_history=-e["amax_history"] - 1), "amax history .* must hold floats >= 0"),
    (lambda e: e.update(amax_history=torch.ones(4, 3, dtype=torch.int64)), r"amax history \(torch.int64\) must hold"),
])
def test_fp8_state_that_would_load_damaged_is_refused_before_any_layer_changes(damage, match):
    model, mp, state = _delayed_state()
    damage(state["fp8"]["layers"][sorted(state["fp8"]["layers"])[-1]])
    before = {n: (m.fp8_amax_history.clone(), m.fp8_scale.clone()) for n, m in fp8_layers(model)}
    with pytest.raises(ValueError, match=match):
        mp.load_state_dict(state)
    for n, m in fp8_layers(model):
        assert torch.equal(m.fp8_amax_history, before[n][0]) and torch.equal(m.fp8_scale, before[n][1]), n


def test_a_checkpoint_of_the_same_delayed_recipe_without_its_fp8_state_is_refused():
    _, _, state = _delayed_state()
    _, mp, _ = build("fp8-delayed", seed=1, fp8={"amax_history_len": 4})
    cut = {k: v for k, v in state.items() if k != "fp8"}
    with pytest.raises(ValueError, match=r"of recipe 'fp8-delayed' but holds no fp8 scaling state.*resume from scale 1"):
        mp.load_state_dict(cut)  # loaded before: every layer quietly back at scale 1, another run
    mp.load_state_dict({**cut, "fp8": mp.state_dict()["fp8"]})  # the way out it names
    plain = MixedPrecision("bf16-mixed", "cpu")  # another recipe's checkpoint, asked for with strict=False: as before
    plain.prepare(tiny_gpt())
    mp.load_state_dict(plain.state_dict(), strict=False)


def test_a_delayed_checkpoint_saved_before_any_step_loads_without_fp8_state():
    # 0 steps: no scaling state was ever measured, so there is nothing for the checkpoint to miss
    _, early, _ = build("fp8-delayed", seed=1, fp8={"amax_history_len": 4})
    state = {k: v for k, v in early.state_dict().items() if k != "fp8"}
    assert state.get("steps", 0) == 0
    _, mp, _ = build("fp8-delayed", seed=1, fp8={"amax_history_len": 4})
    mp.load_state_dict(state)
    _, _, trained = _delayed_state()
    assert trained["steps"] > 0
    with pytest.raises(ValueError, match="holds no fp8 scaling state"):
        mp.load_state_dict({k: v for k, v in trained.items() if k != "fp8"})


def test_two_eval_loops_on_weights_swapped_through_data_each_cast_their_own_weights():
    # evaluate the raw weights, then an EMA copy swapped in through .data (no version bump): the
    # second loop must not reuse the first loop's cast
    model, mp, opt = build("fp8-current")
    train(model, mp, opt, range(2))
    x = torch.randint(0, 96, (4, 16))
    model.eval()
    with torch.no_grad(), mp.autocast():
        raw = model(x)
    for p in model.parameters():
        p.data.mul_(0.5)
    with torch.no_grad(), mp.autocast():
        ema = model(x)
        want = copy.deepcopy(model)(x)  # (copies hold no cached cast)
    assert torch.equal(ema, want) and not torch.equal(ema, raw)
