"""The machine's measured matmul ceiling per dtype, and the TF32 switch.

A datasheet rate is a lead, not a ceiling: the fraction of peak a recipe reaches is taken against a
large square matmul in the same dtype, measured in the same run on the same (possibly busy) machine.
Two layouts are timed, ``A @ B`` and ``A @ B.T`` (what ``nn.Linear`` runs), and the faster counts:
on this AVX2 CPU the emulated 16-bit ``A @ B.T`` goes through oneDNN and is 3-5x faster than
``A @ B``, and a ceiling below what the block itself achieves would be no ceiling.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from mixprec.instruments.timing import Summary, time_call
from mixprec.formats import get_format, short_name

#: Square matmul size per (device type, peak key). Large enough to fill an H200 (8192: 1.1 TFLOP,
#: ~1.4 ms in bf16), small enough that emulated 16-bit on this CPU takes well under a second.
PEAK_SIZES: dict[str, dict[str, int]] = {
    # e4m3: torch._scaled_mm (fp8 GEMMs, sm89+), what an fp8 recipe's linears run; not timed on the CPU,
    # where torch runs it by a slow reference loop (seconds for 512^3)
    "cuda": {"f32": 8192, "tf32": 8192, "bf16": 8192, "f16": 8192, "e4m3": 8192},
    "cpu": {"f32": 1024, "bf16": 512, "f16": 512},
}


@contextlib.contextmanager
def tf32(enabled: bool) -> Iterator[None]:
    """Let fp32 matmuls on CUDA use TF32 tensor cores (``enabled``) or not, restoring the setting after.

    Uses ``torch.set_float32_matmul_precision`` ("high" = TF32, "highest" = IEEE fp32) only: torch
    2.9+ refuses to read the precision once the legacy ``allow_tf32`` flag and the new
    ``fp32_precision`` API have been mixed.
    """
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def peak_key(compute_dtype: torch.dtype, tf32_enabled: bool, device: torch.device, fp8: bool = False) -> str:
    """Which measured peak a recipe's compute is judged against (``f32``, ``tf32``, ``bf16``, ``f16``; ``e4m3``
    for an fp8 recipe whose linears run ``torch._scaled_mm``)."""
    if fp8:
        return "e4m3"
    name = short_name(compute_dtype)
    return "tf32" if name == "f32" and tf32_enabled and device.type == "cuda" else name


def peak_keys(device: torch.device) -> list[str]:
    return list(PEAK_SIZES.get(device.type, PEAK_SIZES["cpu"]))


def measure_matmul_peak(key: str, device: torch.device, n: int | None = None, repeat: int = 3, rounds: int = 3) -> dict:
    """FLOP/s of an ``n x n x n`` matmul in the dtype named by ``key`` (``tf32`` = fp32 with TF32 on).

    Returns ``{"key", "dtype", "n", "flops_per_s", "layouts": {layout: seconds}}``; the rate is the
    faster layout's median over ``rounds`` timings of ``repeat`` back-to-back products.
    """
    dtype = torch.float32 if key == "tf32" else get_format(key).dtype
    if n is None:
        n = PEAK_SIZES.get(device.type, PEAK_SIZES["cpu"]).get(key, 1024)
        if device.type == "cpu" and key == "bf16":
            from mixprec.recipes import cpu_bf16_support

            if cpu_bf16_support()[0]:  # AMX / AVX512-BF16: a real peak needs the larger product (512 reads ~10% low)
                n = 1024
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    layouts = {"nn": lambda: torch.mm(a, b), "nt": lambda: F.linear(a, b)}
    if a.dtype.itemsize == 1:  # fp8: _scaled_mm takes (row-major, column-major) only, unit scales
        one = torch.ones((), device=device)
        b_cm = b.t().contiguous().t()
        layouts = {"scaled_mm": lambda: torch._scaled_mm(a, b_cm, scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                                         use_fast_accum=True)}
    seconds: dict[str, float] = {}
    with tf32(key == "tf32"):
        for name, fn in layouts.items():
            fn()  # warm-up: handles, kernels, oneDNN primitive caches
            seconds[name] = Summary.of([time_call(fn, device, repeat) for _ in range(rounds)]).median
    best = min(seconds.values())
    return {"key": key, "dtype": str(dtype), "n": n, "flops_per_s": 2 * n**3 / best, "layouts": seconds}
