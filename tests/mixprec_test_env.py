"""Helpers shared by tests in every directory (tests/ is on pytest's pythonpath)."""


def src_env() -> dict[str, str]:
    """Environment for subprocesses: import mixprec from this checkout's src/, installed or not."""
    import os
    from pathlib import Path

    src = str(Path(__file__).resolve().parents[1] / "src")
    env = dict(os.environ)
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def bf16_sdpa_error() -> str | None:
    """Why bf16 ``scaled_dot_product_attention`` cannot run on this CPU build, or None when it can.

    torch 2.13's CPU flash-attention kernel, built for AVX2 or no SIMD at all, calls an AVX-512
    packing routine when the CPU has AMX: with ``ATEN_CPU_CAPABILITY=avx2`` (or ``default``) on
    such a CPU, bf16 SDPA raises "pack_vnni2 is only supported when avx512 is supported". A real
    AVX2-only CPU has no AMX and is not affected. Tests that need bf16 SDPA skip with this reason.
    """
    return _bf16_sdpa_error_cached()


def _probe_bf16_sdpa() -> str | None:
    import torch
    import torch.nn.functional as F

    q = torch.randn(1, 2, 64, 32, dtype=torch.bfloat16)
    try:
        F.scaled_dot_product_attention(q, q, q)
    except RuntimeError as e:
        return f"bf16 SDPA does not run with this CPU capability: {e}"
    return None


_SDPA: list[str | None] = []


def _bf16_sdpa_error_cached() -> str | None:
    if not _SDPA:
        _SDPA.append(_probe_bf16_sdpa())
    return _SDPA[0]
