"""Models (and tasks over them) that low-precision inference must judge right.

- ``TinyLM``: a Llama-shaped stand-in for a Hugging Face causal LM (its own RMSNorm class, as
  ``LlamaRMSNorm`` is, SiLU-gated MLP, tied input/output embeddings, ``forward(input_ids=...)``
  returning a mapping with ``logits``): fp16 and bf16 agree with fp32.
- ``Overflow``: a Linear ``amp`` whose outputs reach ~4e5 in fp32: fp16 (max 65504) turns them to
  inf, bf16 keeps fp32's range. fp16 is broken at ``amp``.
- ``LogitOverflow``: attention whose logits (``q @ k.T``, an op in the block's forward, not a
  module) pass 65504 while the block's output stays small: fp16 is broken inside ``attn``.
- ``Cancel``: ``lin(x + 16) - lin(16)`` written in the forward: bf16's 8 bits lose x's low bits
  next to 16 (SQNR ~30 dB: degraded), fp16's 11 keep them (agree).

Run one: ``mixprec infer-check --task tests.inference.zoo:make_overflow --dtype fp16``.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from mixprec.tasks import Task


class RMSNorm(nn.Module):
    """As Hugging Face writes it: a plain module that computes in fp32 and hands back the input's dtype."""

    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm = RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.mlp_norm = RMSNorm(d)
        self.gate = nn.Linear(d, 2 * d, bias=False)
        self.up = nn.Linear(d, 2 * d, bias=False)
        self.down = nn.Linear(2 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))  # (B, H, T, C/H)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // self.heads)
        att = att.masked_fill(torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        x = x + self.o((att.softmax(-1) @ v).transpose(1, 2).reshape(B, T, C))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 128, d: int = 32, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.embed.weight  # tied, as GPT-2 and many LMs are

    def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return {"logits": self.lm_head(self.norm(x))}


def lm_batches(n: int, vocab: int = 128, batch: int = 4, seq: int = 16, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, vocab, (batch, seq), generator=g)} for _ in range(n)]


class Overflow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.amp = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 4)
        with torch.no_grad():
            self.amp.weight.mul_(3e5)  # outputs of a few 1e5: fine in fp32 and bf16, inf in fp16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.amp(torch.relu(self.inp(x)))))


class Attention(nn.Module):
    def __init__(self, d: int = 16, sharpen: float = 200.0) -> None:
        super().__init__()
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.sharpen = sharpen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self.q(x) * self.sharpen, self.k(x) * self.sharpen  # logits ~ sharpen^2: past 65504
        return (q @ k.transpose(-2, -1)).softmax(-1) @ self.v(x)


class LogitOverflow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention()
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x))


class Cancel(nn.Module):
    def __init__(self, offset: float = 16.0) -> None:
        super().__init__()
        self.offset = offset
        self.lin = nn.Linear(16, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a difference of two large, close values, written in the forward (no module of its own)
        return self.head(self.lin(x + self.offset) - self.lin(torch.full_like(x, self.offset)))


def _task(name: str, build, shape: tuple[int, ...], classes: int) -> Task:
    def get_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(7_000 + step)
        return torch.randn(*shape, generator=g), torch.randint(0, classes, shape[:-1], generator=g)

    return Task(name=name, build_model=build, get_batch=get_batch,
                loss_fn=lambda out, y: F.cross_entropy(out.float().reshape(-1, classes), y.reshape(-1)), steps=10)


def make_overflow() -> Task:
    return _task("overflow", Overflow, (32, 8), 4)


def make_logit_overflow() -> Task:
    return _task("logit-overflow", LogitOverflow, (4, 6, 16), 4)


def make_cancel(offset: float = 16.0) -> Task:
    return _task("cancel", lambda: Cancel(offset), (64, 16), 4)


def make_tiny_lm() -> Task:
    def get_batch(step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        ids = lm_batches(1, seed=step)[0]["input_ids"]
        return {"input_ids": ids}, ids.roll(-1, dims=1)

    return Task(name="tiny-lm", build_model=TinyLM, get_batch=get_batch,
                loss_fn=lambda out, y: F.cross_entropy(out["logits"].float().reshape(-1, 128), y.reshape(-1)),
                forward=lambda model, inputs: model(**inputs), steps=10)
