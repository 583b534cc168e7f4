"""Tiny Hugging Face models built from configs (random weights, nothing downloaded): fp16 and bf16
inference agree with fp32, and the cast model generates without an autocast context.

transformers is a test-only extra: these tests skip when it is not installed."""

import pytest
import torch

transformers = pytest.importorskip("transformers")


def _gpt2():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=256, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def _llama():
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=32,
                                   bos_token_id=0, eos_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


def _batches(n=2):
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(0, 256, (2, 16), generator=g), "use_cache": False} for _ in range(n)]


@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_fp16_and_bf16_inference_agree_with_fp32(build):
    from mixprec.inference import check_inference

    torch.manual_seed(0)
    report = check_inference(build(), _batches(), "both")
    assert report.verdict == "agree", report.summary()
    for name, floor in (("bf16", 40.0), ("fp16", 58.0)):  # measured ~50 / ~68 dB on both
        (logits,) = report.results[name].outputs  # the ModelOutput's only tensor with use_cache=False
        assert logits.name == "logits" and logits.classes
        assert logits.sqnr > floor, (name, logits.sqnr)
        assert logits.top1 >= 0.99 and logits.top1_ties_aside >= 0.99


def test_the_cast_model_generates_outside_autocast():
    from mixprec.inference import cast_for_inference, cast_info

    torch.manual_seed(0)
    model = _gpt2()
    lp = cast_for_inference(model, "fp16")
    assert lp.transformer.h[0].attn.c_attn.weight.dtype == torch.float16
    assert "transformer.ln_f" in cast_info(lp).islands  # GPT-2's norms are torch LayerNorms
    ids = _batches(1)[0]["input_ids"]
    mask = torch.ones_like(ids)
    out = lp.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 19)
