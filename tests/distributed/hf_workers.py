"""One rank of the Hugging Face FSDP2 tests: ``python hf_workers.py CASE[,CASE...] OUT``.

A case is ``model/recipe``: a tiny GPT-2 (its default tied ``wte`` / ``lm_head``, Conv1D blocks),
Llama with ``tie_word_embeddings=True`` or T5 (``shared``, both ``embed_tokens`` and ``lm_head``
tied), built from configs (no download), under ``parallel="fsdp"`` on 2 ranks against one process
that trains the same global batch as two accumulated micro-batches in rank order (one SGD step,
lr 0.5). Each rank writes, per parameter, the largest difference to one process, and for a tied
parameter that difference against its bound; the loss; and the dtype in which a few modules saw
their weights in the forward (what FSDP2 gathered).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

torch.set_num_threads(1)

import mixprec  # noqa: E402
import workers as W  # noqa: E402  (digest, params)

RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
VOCAB, SEQ = 96, 16


def build(name: str) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    if name == "gpt2":
        cfg = tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0)
        return tf.GPT2LMHeadModel(cfg)
    if name == "llama":
        cfg = tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ,
                             tie_word_embeddings=True)
        return tf.LlamaForCausalLM(cfg)
    cfg = tf.T5Config(d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=4, vocab_size=VOCAB, dropout_rate=0.0,
                      decoder_start_token_id=0, pad_token_id=0)
    return tf.T5ForConditionalGeneration(cfg)


def batch(step: int, k: int, n: int = WORLD) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (2 * WORLD, SEQ), generator=torch.Generator().manual_seed(100 + step))
    return ids.chunk(n)[k]


WATCH = {"gpt2": ("transformer.h.0.attn.c_attn", "transformer.h.0.mlp.c_fc", "lm_head", "transformer.wte"),
         "llama": ("model.layers.0.self_attn.q_proj", "lm_head", "model.embed_tokens"),
         "t5": ("encoder.block.0.layer.0.SelfAttention.q", "lm_head", "shared")}


SCALE = 2.0**16  # fp16 recipes: the ranks' loss scale; the reference runs at twice it (see below)


def _mp(recipe: str, parallel: str | None) -> mixprec.MixedPrecision:
    # one process backpropagates (loss / 2) * its scale, a rank loss * its scale: at the same scale the
    # backward's fp16 values are the same (else some fall below fp16's normal range at one scale only)
    scaler = None if not recipe.startswith("fp16") else {"init_scale": SCALE if parallel else 2 * SCALE}
    return mixprec.MixedPrecision(recipe, "cpu", accumulate=1 if parallel else WORLD, scaler=scaler)


def train(name: str, recipe: str, parallel: str | None, lr: float = 0.5) -> dict:
    """One SGD step (the update is lr * the gradient: a gradient's rounding shows as it is)."""
    model = build(name)
    mp = _mp(recipe, parallel)
    model = mp.prepare(model, parallel=parallel) if parallel else mp.prepare(model)
    seen: dict[str, str] = {}
    for mod in WATCH[name]:
        module = model.get_submodule(mod)
        module.register_forward_pre_hook(
            lambda m, args, mod=mod: None if mod in seen else seen.update({mod: str(m.weight.dtype)[6:]}))
    opt = torch.optim.SGD(mp.parameters(model), lr=lr)
    for k in ([RANK] if parallel else range(WORLD)):
        ids = batch(0, k)
        with mp.autocast():
            out = model(input_ids=ids, labels=ids)
        stats = mp.step(out.loss, opt, max_grad_norm=1e6)
    loss = stats.loss.detach().clone()
    if parallel:
        dist.all_reduce(loss)
        loss /= WORLD
    return {"params": W.params(mp, model), "loss": float(loss), "seen": seen, "skipped": bool(stats.skipped),
            "groups": mp._dist.fsdp_groups if parallel else None}


def tie_terms(name: str, recipe: str) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """For each tied parameter: the sum over its uses and the micro-batches of |that use's gradient|
    (the terms the tied gradient is a sum of, in an order autograd and FSDP2 choose), and their number.
    Computed on a copy with the ties cut (each use its own copy of the values): the same numbers."""
    from mixprec.distributed.fsdp import tied

    model = build(name)
    ties = tied(model)
    for members in ties:
        for other in members[1:]:
            module = model.get_submodule(other)
            module.weight = torch.nn.Parameter(module.weight.detach().clone())
    mixed = recipe.replace("-true", "-mixed")  # (the same compute with fp32 weights, so each use has its grad)
    mp = _mp(mixed, None)
    model = mp.prepare(model)
    sums = {f"{m[0]}.weight": torch.zeros_like(model.get_submodule(m[0]).weight) for m in ties}
    count = dict.fromkeys(sums, 0)
    for k in range(WORLD):
        ids = batch(0, k)
        with mp.autocast():
            out = model(input_ids=ids, labels=ids)
        model.zero_grad(set_to_none=True)
        mp.scaler.scale(out.loss / WORLD).backward()
        for members in ties:
            for mod in members:
                g = model.get_submodule(mod).weight.grad
                if g is not None:  # (T5's ``shared`` itself is never called: its copies are)
                    sums[f"{members[0]}.weight"] += g.detach().float().abs() / mp.scaler.get_scale()
                    count[f"{members[0]}.weight"] += 1
    return sums, count


def main() -> int:
    cases, out_dir = sys.argv[1].split(","), Path(sys.argv[2])

    def body(result: dict) -> None:
        for case in cases:
            name, recipe = case.split("/")
            got = train(name, recipe, "fsdp")
            ref = train(name, recipe, None)
            sums, terms = tie_terms(name, recipe)
            init = dict(build(name).named_parameters())
            u = 2.0**-24
            cells = {}
            for n, r in ref["params"].items():
                d = (got["params"][n] - r).abs()
                cell = {"max_diff": float(d.max()), "update": float((r - init[n].detach()).abs().max()),
                        "size": float(r.abs().max())}
                if n in sums:  # two orders of a sum of m terms differ by <= 2 gamma_(m-1) sum|terms|; then the
                    m = terms[n]  # SGD update p - lr g rounds once on each side (half an ulp of p each)
                    gamma = (m - 1) * u / (1 - (m - 1) * u)
                    bound = 0.5 * 2 * gamma * sums[n] + 2 * u * r.abs() + 1e-30
                    cell["worst"] = float((d / bound).max())
                cells[n] = cell
            result[case] = {"cells": cells, "tied": sorted(sums), "fsdp": {k: v for k, v in got.items() if k != "params"},
                            "one": {k: v for k, v in ref.items() if k != "params"}}

    return W.rank_main(body, out_dir, timeout_s=120)


if __name__ == "__main__":
    W.leave(main())
