"""The built-in task: a small GPT-style character model on a corpus shipped with mixprec.

The corpus (``tasks/data/corpus.txt``, about 400k characters of English prose about training
numerics, lists, tables and Python-like code) was generated for this project by
``scripts/make_corpus.py`` (the project's own text, no outside licence), so the batches, and
every number ``mixprec compare`` and ``doctor`` print on this task, are the same on every Python
installation. Characters map to a fixed 96-symbol vocabulary (printable ASCII plus newline).
Shapes are noted as ``(B, T, C)``: batch, time, channels.
"""

from __future__ import annotations

import functools
import math
from importlib import resources

import torch
from torch import nn
from torch.nn import functional as F

from mixprec.tasks import Task

VOCAB = ["\n"] + [chr(c) for c in range(32, 127)]  # 96 symbols
_INDEX = {ch: i for i, ch in enumerate(VOCAB)}


@functools.lru_cache(maxsize=1)
def corpus() -> torch.Tensor:
    """The corpus as a 1-D int64 tensor of vocabulary indices."""
    text = resources.files("mixprec.tasks").joinpath("data", "corpus.txt").read_text(encoding="ascii")
    space = _INDEX[" "]
    return torch.tensor([_INDEX.get(ch, space) for ch in text], dtype=torch.int64)


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        hs = C // self.n_head
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)
        # explicit logits (not sdpa) so that diagnostics can see them: the classic fp16 overflow site
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))  # (B, nh, T, T)
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        return self.proj(y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class CharGPT(nn.Module):
    def __init__(self, vocab: int = len(VOCAB), d_model: int = 64, n_layer: int = 2, n_head: int = 4, seq_len: int = 64) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # (B, T, vocab)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def make_task(
    steps: int = 200,
    batch_size: int = 8,
    seq_len: int = 32,
    d_model: int = 48,
    n_layer: int = 2,
    n_head: int = 4,
    lr: float = 3e-3,
    data_seed: int = 1234,
) -> Task:
    """The built-in character-level GPT task (the default of ``compare`` and ``doctor``).

    The defaults are sized for CPUs without native 16-bit matmul (bf16/fp16 are emulated there,
    3-5x slower than fp32 per step): the default ``mixprec compare`` (five runs of 200 steps) takes
    about a minute on two cores, and the loss still falls from ~4.6 (uniform over 96 symbols) to ~2.6.
    """
    for name, value in (("steps", steps), ("batch_size", batch_size), ("seq_len", seq_len), ("d_model", d_model),
                        ("n_layer", n_layer), ("n_head", n_head)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"charlm task: {name} must be a positive integer, got {value!r}")
    if d_model % n_head:
        raise ValueError(f"charlm task: d_model ({d_model}) must be a multiple of n_head ({n_head})")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
        raise ValueError(f"charlm task: lr must be a number > 0, got {lr!r}")
    data = corpus()

    def get_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(data_seed * 1_000_003 + step)
        starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size,), generator=g)
        x = torch.stack([data[s : s + seq_len] for s in starts.tolist()])  # (B, T)
        y = torch.stack([data[s + 1 : s + seq_len + 1] for s in starts.tolist()])
        return x, y

    return Task(
        name="charlm",
        build_model=lambda: CharGPT(len(VOCAB), d_model, n_layer, n_head, seq_len),
        get_batch=get_batch,
        loss_fn=lm_loss,
        build_optimizer=lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=0.0),
        steps=steps,
        max_grad_norm=1.0,
        description=f"char GPT d={d_model} L={n_layer} H={n_head} T={seq_len} B={batch_size} on the shipped corpus",
    )
