"""cast_for_inference: which parameters go to 16 bits, which modules become islands, and that the
cast model runs with no autocast context around it."""

import pytest
import torch
from torch import nn

from inference.zoo import RMSNorm, TinyLM, lm_batches
from mixprec import islands
from mixprec.inference import cast_for_inference, cast_info, recipe_for
from mixprec.masters.rules import fp32_param_names
from mixprec.tasks.charlm import CharGPT
from mixprec.training import MixedPrecision


def _char_gpt():
    torch.manual_seed(0)
    return CharGPT(d_model=16, n_layer=1, n_head=2, seq_len=16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_storage_keeps_the_storage_recipes_fp32_parameters_and_casts_the_rest(dtype):
    model = _char_gpt()
    lp = cast_for_inference(model, dtype)
    rules = recipe_for(dtype, "storage").fp32_params
    assert rules == ("norms", "biases", "embeddings", "bare")  # bf16-true's / fp16-true's, not a new rule
    keep = set(fp32_param_names(model, rules))
    for name, p in lp.named_parameters():
        assert p.dtype == (torch.float32 if name in keep else dtype), name
    assert {"blocks.0.qkv.weight", "head.weight"} <= {n for n, p in lp.named_parameters() if p.dtype == dtype}
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the fp32 model is untouched
    info = cast_info(lp)
    assert info.recipe == ("bf16-true" if dtype == torch.bfloat16 else "fp16-true")
    assert info.bytes_fp32 == 4 * sum(p.numel() for p in model.parameters())
    assert info.bytes_now == sum(p.numel() * (4 if n in keep else 2) for n, p in model.named_parameters())


def test_islands_are_the_mixed_recipes_and_come_from_the_islands_rule():
    model = _char_gpt()
    lp = cast_for_inference(model, "fp16", mode="autocast")
    assert all(p.dtype == torch.float32 for p in lp.parameters())
    assert cast_info(lp).islands == ("blocks.0.ln1", "blocks.0.ln2", "ln_f")  # the torch LayerNorms
    assert recipe_for("fp16", "autocast").fp32_modules == ("norms",)


def test_the_norms_family_is_asked_not_copied(monkeypatch):
    # the training recipes' rule for "norms" (which knows a hand-written RMSNorm by its name) is
    # what the cast uses: the zoo's own RMSNorm class becomes an island and stays fp32
    assert islands.is_norm(RMSNorm(4))
    torch.manual_seed(0)
    lp = cast_for_inference(TinyLM(layers=1), "bf16")
    assert set(cast_info(lp).islands) == {"layers.0.attn_norm", "layers.0.mlp_norm", "norm"}
    assert lp.norm.weight.dtype == torch.float32  # and fp32_param_names' "norms" follows it too


def test_tied_weights_stay_tied_and_the_model_runs_outside_any_autocast():
    torch.manual_seed(0)
    model = TinyLM()
    lp = cast_for_inference(model, "fp16", fp32_params=())  # every parameter 16-bit, the embedding too
    assert lp.lm_head.weight is lp.embed.weight and lp.embed.weight.dtype == torch.float16
    ids = lm_batches(1)[0]
    assert not torch.is_autocast_enabled("cpu")
    out = lp(**ids)["logits"]  # no autocast context, no dtype mismatch
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    assert not torch.is_autocast_enabled("cpu")  # and the model's own autocast did not leak


def test_inplace_casts_the_model_itself_and_puts_it_in_eval_mode():
    model = _char_gpt().train()
    lp = cast_for_inference(model, "bf16", inplace=True)
    assert lp is model and not model.training and model.head.weight.dtype == torch.bfloat16


def test_extra_islands_and_no_islands():
    lp = cast_for_inference(_char_gpt(), "bf16", fp32_modules=["norms", "head"])
    assert "head" in cast_info(lp).islands
    assert cast_info(cast_for_inference(_char_gpt(), "bf16", fp32_modules=())).islands == ()


def test_refuses_what_is_not_a_plain_fp32_model():
    with pytest.raises(ValueError, match="model.float"):
        cast_for_inference(_char_gpt().half(), "fp16")
    with pytest.raises(ValueError, match="already cast"):
        cast_for_inference(cast_for_inference(_char_gpt(), "fp16"), "bf16")
    with pytest.raises(ValueError, match="prepared for training with recipe 'bf16-mixed'"):
        cast_for_inference(MixedPrecision("bf16-mixed", device="cpu").prepare(_char_gpt()), "bf16")
    with pytest.raises(ValueError, match="bf16 or fp16"):
        cast_for_inference(_char_gpt(), "e4m3")
    with pytest.raises(ValueError, match="storage, autocast"):
        cast_for_inference(_char_gpt(), "bf16", mode="pure")
    with pytest.raises(ValueError, match="mode='storage'"):
        cast_for_inference(_char_gpt(), "bf16", mode="autocast", fp32_params=["norms"])
    with pytest.raises(TypeError, match="nn.Module"):
        cast_for_inference("model", "bf16")


def test_a_linear_in_bf16_and_fp16_is_within_the_rounding_bound():
    # y = W x with x, W rounded to the format (relative error <= u each) and y rounded again: the
    # RMS error is at most 3u of the RMS signal for independent zero-mean terms, so the SQNR is at
    # least -20 log10(3u): 38.6 dB for bf16 (u = 2^-8), 56.6 dB for fp16 (u = 2^-11)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(256, 256, bias=False))
    x = torch.randn(64, 256)
    ref = (x.double() @ net[0].weight.double().T)
    for dtype, u in ((torch.bfloat16, 2.0**-8), (torch.float16, 2.0**-11)):
        out = cast_for_inference(net, dtype)(x).double()
        sqnr = 10 * torch.log10((ref**2).sum() / ((out - ref) ** 2).sum())
        assert sqnr >= -20 * torch.log10(torch.tensor(3 * u)), (dtype, float(sqnr))


def test_the_cast_model_saves_as_the_fp32_one_does():
    import io
    import inspect

    torch.manual_seed(0)
    model = TinyLM()
    lp = cast_for_inference(model, "bf16")
    assert list(lp.state_dict()) == list(model.state_dict())  # same keys: a deployment loads them as usual
    assert list(inspect.signature(lp.forward).parameters) == ["input_ids"]
    buf = io.BytesIO()
    torch.save(lp, buf)  # the whole module, its forward wrapper included
    buf.seek(0)
    again = torch.load(buf, weights_only=False)
    ids = lm_batches(1)[0]
    assert torch.equal(again(**ids)["logits"], lp(**ids)["logits"])  # the same computation, bit for bit
