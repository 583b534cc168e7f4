"""The reference workload: one pre-LN transformer block, and the FLOPs it costs.

The seeds' shape is model dimension 1024, batch 32, sequence 512 (``ref``). This CPU runs 16-bit
matmuls by emulation, so ``cpu`` is a scaled-down shape on which one interleaved pass over every
recipe takes a few minutes, and ``tiny`` is for tests.

FLOPs are counted analytically, matmuls only (norms, GELU, softmax, the loss and the optimizer are
elementwise and left out, as MFU conventions do):

    forward  = 2 * P_mm * N + 4 * B * T^2 * d      P_mm = 12 d^2 (qkv 3d^2, proj d^2, MLP 8d^2), N = B*T
    backward = 2 * forward                          (each matmul's input grad and weight grad)
    step     = 3 * forward

The attention is bidirectional (not causal) on purpose: a causal kernel skips half the score
matrix, and counting the full 4*B*T^2*d for it would overstate the achieved rate.
tests/bench/test_bench_block.py checks the formula against ``torch.utils.flop_counter``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True)
class Shape:
    """A block and batch size. ``d_model`` must divide by ``n_head``."""

    name: str
    d_model: int
    n_head: int
    batch: int
    seq: int
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(f"shape {self.name!r}: d_model={self.d_model} is not divisible by n_head={self.n_head}")

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    def describe(self) -> str:
        return f"d={self.d_model} heads={self.n_head} B={self.batch} T={self.seq} mlp={self.mlp_ratio}x"


SHAPES: dict[str, Shape] = {
    "ref": Shape("ref", d_model=1024, n_head=16, batch=32, seq=512),
    # ~2.6 GFLOP a step: ~0.3 s in fp32 here, a few seconds in emulated bf16/fp16.
    "cpu": Shape("cpu", d_model=256, n_head=4, batch=4, seq=128),
    # small enough that Python overhead shows: what the step-overhead comparison uses on CPU.
    "small": Shape("small", d_model=128, n_head=4, batch=4, seq=64),
    "tiny": Shape("tiny", d_model=32, n_head=2, batch=2, seq=16),
}


def get_shape(name: str | Shape) -> Shape:
    if isinstance(name, Shape):
        return name
    try:
        return SHAPES[name]
    except KeyError:
        raise ValueError(f"Unknown shape {name!r}; expected one of {', '.join(SHAPES)}") from None


class RefBlock(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``; attention through
    ``F.scaled_dot_product_attention`` (so each device takes its fastest kernel), MLP with GELU."""

    def __init__(self, shape: Shape) -> None:
        super().__init__()
        d, hidden = shape.d_model, shape.mlp_ratio * shape.d_model
        self.n_head = shape.n_head
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, hidden)
        self.out = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        hs = C // self.n_head
        qkv = self.qkv(self.ln1(x)).view(B, T, 3, self.n_head, hs).permute(2, 0, 3, 1, 4)  # (3, B, nh, T, hs)
        y = self.attend(qkv[0], qkv[1], qkv[2])  # (B, nh, T, hs)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The attention product (a subclass may route it elsewhere: benchmarks/attention_cpu.py)."""
        return F.scaled_dot_product_attention(q, k, v)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """MSE against a random target, in fp32 (the seeds: the loss stays in fp32)."""
    return F.mse_loss(output.float(), target)


def make_batches(shape: Shape, device: torch.device | str, count: int = 2, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` (input, target) pairs of random normal data (never zeros: they can run faster)."""
    g = torch.Generator().manual_seed(seed)
    size = (shape.batch, shape.seq, shape.d_model)
    return [(torch.randn(size, generator=g).to(device), torch.randn(size, generator=g).to(device)) for _ in range(count)]


def matmul_params(shape: Shape) -> int:
    """Weights that take part in matmuls: qkv, proj and the two MLP layers (biases excluded)."""
    d, hidden = shape.d_model, shape.mlp_ratio * shape.d_model
    return 3 * d * d + d * d + 2 * d * hidden


def block_flops(shape: Shape) -> dict[str, int]:
    """Matmul FLOPs of one forward, one backward and one training step (see the module docstring)."""
    fwd = 2 * matmul_params(shape) * shape.tokens + 4 * shape.batch * shape.seq**2 * shape.d_model
    return {"forward": fwd, "backward": 2 * fwd, "step": 3 * fwd}


FLOP_FORMULA = "forward = 2*P_mm*B*T + 4*B*T^2*d (P_mm = 12*d^2 at MLP 4x); backward = 2*forward; step = 3*forward"
