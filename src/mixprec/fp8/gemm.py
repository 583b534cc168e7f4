"""The three GEMMs of an fp8 linear, from fp8 operands, on one of two backends.

Suffixes as in ``casts``: ``_q`` fp8 bits, ``s`` their scale (``hp ~ q / s``). With N tokens:

    output      = x @ w.T       x_q (N, in),  w_q (out, in)
    grad_input  = g @ w         g_q (N, out), w_q (out, in)
    grad_weight = g.T @ x       g_q (N, out), x_q (N, in)      (always fp32: the weights are fp32)

- ``"emulate"``: dequantize each operand to fp32 and multiply in fp32 (``torch.mm``), then round to
  the output dtype. Exact in the sense that matters: every operand value is what an fp8 GEMM
  multiplies, and the products accumulate in fp32, as the hardware's do. The operand layouts and the
  division by the scale are torchao's ``Float8Linear(emulate=True)``'s, which makes the results bitwise
  equal to it (tests/fp8/test_fp8_torchao.py).
- ``"scaled_mm"``: ``torch._scaled_mm`` (cuBLASLt fp8 GEMMs on sm89+; torch's CPU build runs it too,
  very slowly). It wants the first operand row-major and the second column-major, the inverse
  scales, and a reduction dimension that is a multiple of 16 (the tokens of the weight gradient are
  zero-padded to one). The output GEMM uses fast accumulation, as torchao's default does; the gradient GEMMs do
  not. Rowwise scaling needs a bf16 output on CUDA: the result is then cast to the wanted dtype.
"""

from __future__ import annotations

import torch

from mixprec.fp8.casts import dequantize_raw as dequantize


def _col_major(t: torch.Tensor) -> torch.Tensor:
    """The same matrix, stored column-major (what ``_scaled_mm`` wants as its second operand)."""
    return t.t().contiguous().t()


def _pad_inner(a_q: torch.Tensor, b_q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-pad the reduction dimension to a multiple of 16, as cuBLASLt's fp8 GEMMs require (the
    weight gradient reduces over the tokens, which can be any number): zeros add nothing."""
    k = a_q.shape[1]
    extra = -k % 16
    if not extra:
        return a_q, b_q
    a8, b8 = a_q.view(torch.uint8), b_q.view(torch.uint8)  # (fp8 has no pad kernel; bits 0 are +0.0)
    a8 = torch.cat([a8, a8.new_zeros(a8.shape[0], extra)], dim=1)
    b8 = torch.cat([b8, b8.new_zeros(extra, b8.shape[1])], dim=0)
    return a8.view(a_q.dtype), b8.view(b_q.dtype)


def _scaled_mm(a_q: torch.Tensor, sa: torch.Tensor, b_q: torch.Tensor, sb: torch.Tensor, out_dtype: torch.dtype,
               fast: bool) -> torch.Tensor:
    rowwise = sa.numel() > 1 or sb.numel() > 1
    dtype = torch.bfloat16 if rowwise and a_q.is_cuda else out_dtype
    a_q, b_q = _pad_inner(a_q, b_q)
    out = torch._scaled_mm(a_q.contiguous(), b_q if b_q.stride(0) == 1 else _col_major(b_q),
                           scale_a=sa.reciprocal(), scale_b=sb.reciprocal(), out_dtype=dtype, use_fast_accum=fast)
    return out.to(out_dtype)


def output(x_q: torch.Tensor, sx: torch.Tensor, w_q: torch.Tensor, sw: torch.Tensor, out_dtype: torch.dtype,
           backend: str) -> torch.Tensor:
    """``x @ w.T`` (rowwise: ``sx`` is (N, 1), ``sw`` is (out, 1))."""
    if backend == "emulate":
        return torch.mm(dequantize(x_q, sx), dequantize(w_q, sw).t()).to(out_dtype)
    return _scaled_mm(x_q, sx, w_q.t(), sw.t(), out_dtype, fast=True)


def grad_input(g_q: torch.Tensor, sg: torch.Tensor, w_q: torch.Tensor, sw: torch.Tensor, out_dtype: torch.dtype,
               backend: str) -> torch.Tensor:
    """``g @ w`` (rowwise: ``sg`` is (N, 1), ``sw`` is (1, in): scaled along ``out``, the reduction)."""
    if backend == "emulate":
        return torch.mm(dequantize(g_q, sg), dequantize(w_q, sw)).to(out_dtype)
    return _scaled_mm(g_q, sg, w_q, sw, out_dtype, fast=False)


def grad_weight(g_q: torch.Tensor, sg: torch.Tensor, x_q: torch.Tensor, sx: torch.Tensor, backend: str) -> torch.Tensor:
    """``g.T @ x`` in fp32 (rowwise: ``sg`` is (1, out), ``sx`` is (1, in): scaled along the tokens)."""
    if backend == "emulate":
        return torch.mm(dequantize(g_q, sg).t(), dequantize(x_q, sx))
    return _scaled_mm(g_q.t(), sg.t(), x_q, sx, torch.float32, fast=False)
