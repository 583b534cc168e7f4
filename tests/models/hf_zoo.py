"""Real model families built from tiny Hugging Face configs (no download), and one batch each.

Six families: GPT-2 (Conv1D matmuls, tied lm_head), Llama (LlamaRMSNorm, rotary, GQA), BERT
(LayerNorm, token types), T5 (encoder-decoder, T5LayerNorm, relative position bias), and two
vision models, ResNet (conv + BatchNorm) and ViT (bare cls_token / position embeddings). The vision
models are transformers' own: timm is not installed here and torchvision is kept out of the test
environment, so transformers' ResNet and ViT stand in for timm's.

Dropout is off in every config, so that two runs of one model compare bit for bit.
``build(family, seed)`` returns a model in fp32; ``batch(family, seed)`` the keyword arguments of one
training forward (``labels=`` included: HF computes the loss inside its forward); ``loss_of(out)``.
"""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH, IMAGE, LABELS = 64, 8, 2, 16, 10

FAMILIES = ("gpt2", "llama", "bert", "t5", "resnet", "vit")
TEXT = ("gpt2", "llama", "bert", "t5")


def config(family: str, **overrides):
    t = transformers
    ids = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 0}
    if family == "gpt2":
        cfg = t.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=32,
                           bos_token_id=0, eos_token_id=1, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    elif family == "llama":
        cfg = t.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **ids)
    elif family == "bert":
        cfg = t.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=64, max_position_embeddings=64, pad_token_id=0,
                           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    elif family == "t5":
        cfg = t.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                         decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, dropout_rate=0.0)
    elif family == "resnet":
        # ResNet-50's bottleneck blocks, three stages: under fp16-mixed its first steps overflow at
        # the default scale 2^16 (the routine overflow the scaler skips)
        cfg = t.ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32, 64], depths=[1, 1, 1],
                             layer_type="bottleneck", num_labels=LABELS)
    elif family == "vit":
        cfg = t.ViTConfig(image_size=IMAGE, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                          num_attention_heads=2, intermediate_size=64, num_labels=LABELS)
    else:
        raise KeyError(family)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def model_class(family: str):
    t = transformers
    return {"gpt2": t.GPT2LMHeadModel, "llama": t.LlamaForCausalLM, "bert": t.BertForMaskedLM,
            "t5": t.T5ForConditionalGeneration, "resnet": t.ResNetForImageClassification,
            "vit": t.ViTForImageClassification}[family]


def build(family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tiny configs: token-id range notes
        return model_class(family)(config(family, **overrides))


def batch(family: str, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + seed)
    if family in ("resnet", "vit"):
        return {"pixel_values": torch.randn(BATCH, 3, IMAGE, IMAGE, generator=g),
                "labels": torch.randint(0, LABELS, (BATCH,), generator=g)}
    ids = torch.randint(2, VOCAB, (BATCH, SEQ), generator=g)
    if family == "t5":
        return {"input_ids": ids, "labels": torch.randint(2, VOCAB, (BATCH, SEQ // 2), generator=g)}
    return {"input_ids": ids, "labels": ids}


def loss_of(out) -> torch.Tensor:
    return out.loss


def reload(family: str, folder):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model_class(family).from_pretrained(folder)


def check_reloads_exactly(mp, model, family, folder):
    """``mp.save_pretrained`` into ``folder``, then a plain ``from_pretrained``: every tensor fp32 and
    bit for bit the export (the masters' values, not the 16-bit storage); returns the reloaded model."""
    export = mp.fp32_state_dict(model)
    mp.save_pretrained(model, folder)
    with open(os.path.join(folder, "config.json")) as f:
        assert json.load(f)["dtype"] == "float32"
    back = reload(family, folder)
    state = back.state_dict()
    floats = {k: v for k, v in state.items() if v.is_floating_point()}
    assert {v.dtype for v in floats.values()} == {torch.float32}, {k: v.dtype for k, v in floats.items()}
    for key, value in export.items():
        assert key in state, key
        assert torch.equal(state[key], value), key  # bit for bit (fp32 against fp32)
    if mp.masters is not None:  # the exported values are the masters', not the 16-bit storage
        for name, master in mp.masters.masters().items():
            assert torch.equal(state[name], master), name
    return back
