"""Hugging Face models (built from tiny configs, nothing downloaded) with a fault planted in one
module, for ``compare --explain`` (needs transformers; importable as ``explain_hf_tasks:...``).

- ``make_gpt2_task``: GPT-2 with eager attention; layer 1's query and key projections carry a
  large gain: its attention logits q.k (~1.6e5) pass fp16's 65504 in the matmul, inf, and the
  softmax makes NaN. fp32 and bf16 only saturate the softmax. The culprit: ``transformer.h.1.attn``.
- ``make_t5_task``: T5 (ReLU feed-forward, a copy task). Layer 1 of the encoder has feed-forward
  weights large enough (``wi`` and ``wo`` x 300) that ``wo``'s output (~2e5) passes 65504, as the
  large T5 checkpoints' activations do
  (which is why Hugging Face keeps T5's ``wo`` in fp32 under fp16). The culprit:
  ``encoder.block.1.layer.1.DenseReluDense.wo``.
"""

from __future__ import annotations

import torch
from torch import nn

from mixprec.tasks import Task

VOCAB, SEQ, BATCH = 32, 16, 8


def _tokens(step: int) -> torch.Tensor:
    return torch.randint(1, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(50_000 + step))


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make_gpt2_task(steps: int = 40, gain: float = 800.0) -> Task:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = "eager"  # the logits as a matmul of their own (the classic fp16 overflow site)

    def build() -> nn.Module:
        model = GPT2LMHeadModel(cfg)
        with torch.no_grad():  # the plant: layer 1's q and k projections (Conv1D: weight is (in, 3 * out))
            model.transformer.h[1].attn.c_attn.weight[:, : 2 * cfg.n_embd].mul_(gain)
        return model

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = _tokens(step)
        return x, (x + 1) % VOCAB  # the next symbol of each

    return Task(name="gpt2-planted-attention", build_model=build, get_batch=batch, loss_fn=_lm_loss,
                forward=lambda m, x: m(input_ids=x).logits,
                build_optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.0), steps=steps,
                max_grad_norm=1.0, description=f"GPT-2 (2 layers, d=32), layer 1 q/k x {gain:g}")


def make_t5_task(steps: int = 40, gain: float = 300.0) -> Task:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=2,
                   dropout_rate=0.0, feed_forward_proj="relu", decoder_start_token_id=0, pad_token_id=0,
                   eos_token_id=1, use_cache=False)

    def build() -> nn.Module:
        model = T5ForConditionalGeneration(cfg)
        with torch.no_grad():  # the plant: encoder layer 1's feed-forward grows activations past fp16's range
            ff = model.encoder.block[1].layer[1].DenseReluDense
            ff.wi.weight.mul_(gain)
            ff.wo.weight.mul_(gain)
        return model

    def batch(step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        x = _tokens(step)
        decoder_in = torch.cat([torch.zeros(BATCH, 1, dtype=x.dtype), x[:, :-1]], dim=1)
        return {"input_ids": x, "decoder_input_ids": decoder_in}, x  # copy the input

    return Task(name="t5-planted-ffn", build_model=build, get_batch=batch, loss_fn=_lm_loss,
                forward=lambda m, b: m(**b).logits,
                build_optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.0), steps=steps,
                max_grad_norm=1.0, description=f"T5 (2+2 layers, d=32), encoder layer 1 feed-forward x {gain:g}")
