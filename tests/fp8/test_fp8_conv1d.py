"""Hugging Face's Conv1D (GPT-2's projections) in fp8: bitwise an fp8 nn.Linear holding the transposed
weight, and GPT-2 from a config gets its matmuls in fp8 instead of training bf16-mixed under an fp8 name."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch import nn

pytest.importorskip("transformers", reason="Conv1D is Hugging Face's: pip install transformers")
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402
from transformers.pytorch_utils import Conv1D  # noqa: E402

from fp8_helpers import roundtrip  # noqa: E402
from mixprec import MixedPrecision  # noqa: E402
from mixprec.fp8 import fp8_layers, remove_fp8  # noqa: E402
from mixprec.fp8.delayed import update  # noqa: E402
from mixprec.fp8.linear import Fp8Config  # noqa: E402
from mixprec.fp8.swap import convert_  # noqa: E402
from mixprec.recipes import Fp8Spec  # noqa: E402

SPECS = [
    pytest.param({"scaling": "current"}, id="current"),
    pytest.param({"scaling": "current", "granularity": "rowwise"}, id="rowwise"),
    pytest.param({"scaling": "current", "granularity": "rowwise", "format": "e4m3", "pow2_scales": True}, id="torchao-rowwise"),
    pytest.param({"scaling": "delayed", "amax_history_len": 4}, id="delayed"),
    pytest.param({"scaling": "none", "format": "e4m3"}, id="unscaled"),
]


def _pair(spec: dict, n_in: int = 64, n_out: int = 48, seed: int = 0):
    """An fp8 Conv1D and an fp8 nn.Linear with the same numbers (the Linear's weight is the Conv1D's transposed)."""
    torch.manual_seed(seed)
    conv = Conv1D(n_out, n_in)
    with torch.no_grad():
        conv.bias.normal_()
    lin = nn.Linear(n_in, n_out)
    with torch.no_grad():
        lin.weight.copy_(conv.weight.t())
        lin.bias.copy_(conv.bias)
    cfg = Fp8Config.from_spec(Fp8Spec(**spec), "emulate")
    history = spec.get("amax_history_len", 1)
    return convert_(conv, cfg, "conv", history), convert_(lin, cfg, "lin", history)


def _fwd_bwd(layer, x, g, autocast: bool):
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = layer(x)
    y.backward(g.to(y.dtype))
    return y.detach(), x.grad, layer.weight.grad, layer.bias.grad


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_an_fp8_conv1d_is_bitwise_an_fp8_linear_with_the_transposed_weight(spec, autocast):
    conv, lin = _pair(spec)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):  # delayed: three steps, so the later ones cast with scales from a history
        x = torch.randn(2, 8, 64, generator=gen) * (step + 1)
        g = torch.randn(2, 8, 48, generator=gen) * 1e-3
        for m in (conv, lin):
            m.weight.grad = m.bias.grad = None
        (yc, gxc, gwc, gbc), (yl, gxl, gwl, gbl) = _fwd_bwd(conv, x, g, autocast), _fwd_bwd(lin, x, g, autocast)
        assert yc.dtype == yl.dtype and torch.equal(yc, yl)
        assert torch.equal(gxc, gxl) and torch.equal(gbc, gbl)
        assert gwc.shape == (64, 48) and torch.equal(gwc, gwl.t())  # the weight gradient, in the Conv1D's layout
        if spec["scaling"] == "delayed":
            assert torch.equal(conv.fp8_amax_history, lin.fp8_amax_history)
            for m in (conv, lin):
                update([m.fp8_amax_history], [m.fp8_scale], m.fp8_config.formats, "max", 0)
    # and it is the matmul HF's Conv1D computes: within fp8's error of the fp32 layer
    ref = Conv1D(48, 64)
    ref.load_state_dict(conv.state_dict())
    x = torch.randn(16, 64, generator=gen)
    assert torch.nn.functional.cosine_similarity(ref(x).flatten(), conv(x).float().flatten(), dim=0) > 0.99


def test_the_fp8_conv1d_stays_a_conv1d_and_survives_deepcopy_pickle_and_remove_fp8():
    conv, _ = _pair({"scaling": "delayed", "amax_history_len": 4})
    assert isinstance(conv, Conv1D) and type(conv).__name__ == "Fp8Conv1D"
    assert repr(conv).startswith("Fp8Conv1D(nf=48, nx=64, fp8=delayed e4m3/e4m3/e5m2")
    x = torch.randn(4, 64)
    conv.train()
    conv(x).sum().backward()
    for other in (copy.deepcopy(conv), roundtrip(conv), pickle.loads(pickle.dumps(conv))):
        assert type(other) is type(conv) and torch.equal(other.fp8_amax_history, conv.fp8_amax_history)
        assert torch.equal(other(x), conv(x))
    holder = nn.Sequential(conv)
    remove_fp8(holder)
    assert type(holder[0]) is Conv1D and not hasattr(holder[0], "fp8_config")
    assert not any("fp8" in n for n, _ in holder.named_buffers())


def _gpt2(n_layer: int = 2) -> nn.Module:
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=n_layer, n_head=4, bos_token_id=0, eos_token_id=0,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def test_gpt2_from_a_config_runs_its_conv1d_matmuls_in_fp8():
    model = _gpt2()
    keys = list(model.state_dict())
    mp = MixedPrecision("fp8-current", "cpu")
    mp.prepare(model)
    text = mp.describe()
    names = {n for n, _ in fp8_layers(model)}
    convs = [n for n, m in model.named_modules() if isinstance(m, Conv1D)]
    assert len(convs) == 8 and names == set(convs) - {"transformer.h.0.attn.c_attn"}  # the first matmul stays bf16
    assert "7 of 9 nn.Linear and Conv1D in fp8" in text
    assert "transformer.h.0.attn.c_attn" in text and "the first matmul (Conv1D)" in text
    assert "lm_head" in text and "the LM head" in text
    assert list(model.state_dict()) == keys
    opt = torch.optim.AdamW(mp.parameters(model), lr=1e-3)
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        with mp.autocast():
            loss = model(x, labels=x).loss
        mp.step(loss, opt)
    assert torch.isfinite(loss)


def test_gpt2_under_fp8_delayed_resumes_bit_for_bit():
    def run(model, mp, opt, steps):
        losses = []
        for s in steps:
            x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(s))
            with mp.autocast():
                loss = model(x, labels=x).loss
            losses.append(float(mp.step(loss, opt).loss))
        return losses

    def fresh():
        model = _gpt2()
        mp = MixedPrecision("fp8-delayed", "cpu", fp8={"amax_history_len": 4})
        mp.prepare(model)
        return model, mp, torch.optim.AdamW(mp.parameters(model), lr=1e-3)

    model, mp, opt = fresh()
    run(model, mp, opt, range(3))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "mp": mp.state_dict()}, buf)
    straight = run(model, mp, opt, range(3, 6))
    buf.seek(0)
    ck = torch.load(buf, weights_only=False)
    model2, mp2, opt2 = fresh()
    model2.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["opt"])
    mp2.load_state_dict(ck["mp"])
    assert run(model2, mp2, opt2, range(3, 6)) == straight


def test_the_memory_planner_counts_gpt2s_conv1d_as_matmuls_and_its_fp8_copies():
    from mixprec.memory.measure import count_params
    from mixprec.recipes import get_recipe

    model = _gpt2()
    counts = count_params(model, get_recipe("fp8-current"))
    convs = {n: m.weight.numel() for n, m in model.named_modules() if isinstance(m, Conv1D)}
    assert counts.fp8_weights == sum(v for n, v in convs.items() if n != "transformer.h.0.attn.c_attn")
    assert counts.matmul_weights >= sum(convs.values()) >= counts.fp8_weights  # (the bf16 copies: matmul - fp8)
