"""The doctor's gradient-underflow probe, on a JAX gradient pytree.

Where would these gradients land in fp16, bf16 and fp8 at each loss scale: flushed to zero,
subnormal, normal or overflowed? The counting is the torch probe's own (``GradStats`` over the
exact rounding boundaries of ``mixprec.formats``' limits, see
``mixprec.diagnostics.probes.gradients``): each leaf is copied to the host once and counted there,
so the answer is the same ``GradUnderflowReport``, read the same way, as for a torch model.

>>> import jax.numpy as jnp
>>> grads = {"dense": {"kernel": jnp.array([1e-9, 1e-3, 1.0]), "bias": jnp.array([0.5, 0.0])}}
>>> report = probe_grad_underflow(grads)
>>> report.landing("dense.kernel", "f16", scale=1.0).zero      # 1e-9 is below fp16's 2^-24 floor
0.3333333333333333
>>> report.landing("dense.kernel", "f16", scale=2.0**16).zero  # scaled by 2^16 it survives
0.0
>>> [m.name for m in report.by_module()]
['dense']

Gradients of a JAX function are fp32 when the parameters are (the policy's casts are traced), so
pass ``jax.grad(loss_fn)(params, ...)`` computed in fp32, the unscaled gradient the probe assumes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mixprec.diagnostics.probes._common import DEFAULT_FORMATS
from mixprec.diagnostics.probes.gradients import GradStats, GradUnderflowReport, _Grid
from mixprec.formats import get_format


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def leaf_name(path: Sequence[Any]) -> str:
    """A dotted name for a pytree path: ``{"dense": {"kernel": ...}}`` -> ``dense.kernel`` (``[0]`` -> ``0``).

    A Flax NNX state's leaves sit one level below their variable (``dense.kernel.value``): that ``.value``
    is dropped, so the leaf is named by its parameter and grouped under its module (``dense``)."""
    path = list(path)
    if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == "value":
        path = path[:-1]
    return ".".join(_key_name(k) for k in path) or "(root)"


def probe_grad_underflow(
    grads: Any,
    *,
    formats: Sequence[str] = DEFAULT_FORMATS,
    scale_exponents: tuple[int, int] = (-16, 48),
    scales: Iterable[float] = (),
    headroom_bits: int = 1,
) -> GradUnderflowReport:
    """Measure where every floating leaf of ``grads`` lands in ``formats`` at loss scales 2^k.

    Args:
        grads: a gradient pytree (fp32 or fp64, unscaled); non-floating leaves are ignored.
        formats: formats to land in (names ``mixprec.formats`` accepts).
        scale_exponents: measure every scale 2^k for k in this inclusive range.
        scales: further scales to measure.
        headroom_bits: the recommended scale keeps the largest gradient 2^headroom_bits below fp16's max.

    Returns the torch probe's ``GradUnderflowReport``: one ``GradStats`` per leaf (named by its
    dotted path, kind ``"param"``), ``overall``, ``recommended_scale``; ``activations`` is empty
    (a gradient pytree has no module outputs).
    """
    lo, hi = scale_exponents
    if not (isinstance(lo, int) and isinstance(hi, int) and lo <= hi):
        raise ValueError(f"scale_exponents must be two integers (lo, hi) with lo <= hi, got {scale_exponents!r}")
    grid = _Grid(formats, [2.0**k for k in range(lo, hi + 1)] + [float(s) for s in scales])
    import torch  # the counting runs in the torch probe's code, on host copies

    stats: list[GradStats] = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(grads)[0]:
        dtype = jnp.result_type(leaf)
        if not jnp.issubdtype(dtype, jnp.floating):
            continue
        host = np.asarray(leaf)
        # widen 16-bit and fp8 leaves exactly (torch cannot read ml_dtypes); f32 and f64 as they are
        host = host.astype(np.float64 if host.dtype == np.float64 else np.float32)
        s = GradStats(leaf_name(path), "param", grid)
        s.add(torch.from_numpy(np.ascontiguousarray(host)))
        stats.append(s)
    if not stats:
        raise ValueError("probe_grad_underflow found no floating-point leaves in the gradient pytree")
    overall = GradStats("(all)", "overall", grid)
    for s in stats:
        overall.merge(s)
    rec = None
    if overall.absmax > 0:
        k = math.floor(math.log2(get_format("f16").max / overall.absmax)) - headroom_bits
        rec = 2.0 ** min(max(k, lo), hi)  # within the measured range, so its landing can be read
    return GradUnderflowReport(stats, [], overall, rec, headroom_bits, grid.formats, grid.scales)
