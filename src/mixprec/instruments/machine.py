"""What machine a number was measured on: every benchmark and comparison records it.

Machines of one kind differ (an AMD EPYC with AVX2 only, an Intel Xeon with AVX-512 and AMX, where
bf16 matmuls run at many times the fp32 rate): a time without its CPU model, SIMD features, thread
count, torch version and date says little.
"""

from __future__ import annotations

import datetime
import platform
import sys
from typing import Any

import torch

# The CPU's name and the SIMD features that decide 16-bit matmul speed: one place reads them
# (``mixprec.autotune``, which keys its measurements by them), for the core and the tools alike.
from mixprec.autotune import FEATURES, cpu_features, cpu_name  # noqa: E402


def environment(device: torch.device | str = "cpu") -> dict[str, Any]:
    """Date, versions, the device and (on CPU) its model, features, torch's kernel choice and threads."""
    label = str(device)
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):  # another framework's name ("cpu (jax)"): describe the host
        device = torch.device("cpu")
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": label,
        "cpu": cpu_name(),
        "cpu_features": cpu_features(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "command": " ".join(sys.argv),
    }
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    else:
        env["device_name"] = env["cpu"]
    return env


def describe(env: dict[str, Any]) -> str:
    """One line: ``Intel(R) Xeon(R) ... (avx2 avx512f amx_bf16; torch kernels AVX512), 2 threads, torch 2.13.0, 2026-12-01``."""
    feats = " ".join(env.get("cpu_features") or []) or "no AVX2"
    where = env.get("device_name", env.get("cpu", "?"))
    if "jax" in env:  # a JAX run: XLA's kernels and threads, no torch
        return f"{where} ({feats}; XLA {env.get('backend', '?')}), jax {env['jax']}, {str(env.get('date', ''))[:10]}"
    if str(env.get("device", "cpu")).startswith("cuda"):
        where += f" (CUDA {env.get('cuda')}; host CPU {env.get('cpu', '?')})"
    else:
        where += f" ({feats}; torch kernels {env.get('cpu_capability', '?')})"
    return f"{where}, {env.get('threads', '?')} threads, torch {env.get('torch', '?')}, {str(env.get('date', ''))[:10]}"
