"""A model prepared for a 16-bit storage recipe, used outside mp.autocast() the ways Hugging Face and
users call it: ``generate()`` on an encoder-decoder (which calls ``model.get_encoder()(...)``, around
the top-level forward), the base model (``model.model``, ``model.transformer``), a vision backbone,
a head on its own. Each computes what it computes inside mp.autocast(), bit for bit (issue 29.3:
T5's generate() failed with "expected m1 and m2 to have the same dtype" under every storage recipe).
"""

from __future__ import annotations

import pytest
import torch

from hf_zoo import batch, build  # (skips without transformers)
from mixprec import MixedPrecision

STORAGE = ("bf16-true", "fp16-true", "bf16-true-kahan", "bf16-true-sr", "bf16-true-remainder", "bf16-pure",
           "fp16-pure")


@pytest.mark.parametrize("recipe", STORAGE)
def test_t5_generate_outside_autocast_equals_generate_inside(recipe):
    mp = MixedPrecision(recipe, "cpu")
    model = mp.prepare(build("t5")).eval()
    ids = batch("t5")["input_ids"]
    kw = {"max_new_tokens": 5, "do_sample": False}
    with torch.no_grad():
        outside = model.generate(ids, **kw)
        with mp.autocast():
            inside = model.generate(ids, **kw)
    assert torch.equal(outside, inside)
    assert not torch.is_autocast_enabled("cpu")


def _calls(model, family):
    """(what is called, a function calling it) for each family's submodules called on their own."""
    b = batch(family)
    if family == "gpt2":
        h = torch.randn(2, 8, 32)
        return [("transformer", lambda: model.transformer(b["input_ids"]).last_hidden_state),
                ("transformer.h.0.mlp.c_fc", lambda: model.transformer.h[0].mlp.c_fc(h))]
    if family == "llama":
        return [("model", lambda: model.model(b["input_ids"]).last_hidden_state),
                ("lm_head", lambda: model.lm_head(torch.randn(2, 8, 32))),
                ("get_decoder()", lambda: model.get_decoder()(b["input_ids"]).last_hidden_state)]
    if family == "bert":
        return [("bert", lambda: model.bert(b["input_ids"]).last_hidden_state)]
    if family == "t5":
        return [("get_encoder()", lambda: model.get_encoder()(b["input_ids"]).last_hidden_state),
                ("encoder.block.0", lambda: model.encoder.block[0](torch.randn(2, 8, 32))[0])]
    if family == "resnet":
        return [("resnet", lambda: model.resnet(b["pixel_values"]).pooler_output),
                ("resnet.embedder", lambda: model.resnet.embedder(b["pixel_values"]))]
    if family == "vit":
        return [("vit", lambda: model.vit(b["pixel_values"]).last_hidden_state)]
    raise KeyError(family)


@pytest.mark.parametrize("recipe", ["bf16-true", "fp16-true"])
@pytest.mark.parametrize("family", ["gpt2", "llama", "bert", "t5", "resnet", "vit"])
def test_a_submodule_called_on_its_own_outside_autocast_computes_what_it_computes_inside(family, recipe):
    mp = MixedPrecision(recipe, "cpu")
    model = mp.prepare(build(family)).eval()
    for name, call in _calls(model, family):
        with torch.no_grad():
            torch.manual_seed(1)
            outside = call()
            torch.manual_seed(1)
            with mp.autocast():
                inside = call()
        assert outside.dtype == inside.dtype and torch.equal(outside, inside), name
        assert not torch.is_autocast_enabled("cpu"), name


def test_only_modules_holding_16bit_weights_get_the_wrapper_and_training_is_unchanged():
    from mixprec.policy import AutocastForward, PreparedForward

    mp = MixedPrecision("bf16-true", "cpu")
    model = mp.prepare(build("gpt2"))
    root = model.__dict__["forward"]  # the model's own: the output cast, and autocast outside one
    assert isinstance(root, PreparedForward) and root.autocast == ("cpu", torch.bfloat16)
    wrapped = {n for n, m in model.named_modules() if isinstance(m.__dict__.get("forward"), AutocastForward)}
    assert {"transformer", "transformer.h.0", "transformer.h.0.attn.c_attn"} <= wrapped
    # fp32 modules (norms, the embeddings and the head tied to them), parameter-free ones and
    # containers are left alone
    assert not wrapped & {"transformer.ln_f", "transformer.wte", "lm_head", "transformer.h.0.attn.attn_dropout",
                          "transformer.h"}
