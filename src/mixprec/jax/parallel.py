"""Data parallelism with a policy: the gradient all-reduce in fp32, not in the compute dtype.

With fp32 parameters replicated over a mesh axis and the policy's cast inside the step (the docs'
pattern), the reduction of the gradient over the batch shards happens where JAX and XLA put it:
under ``jax.shard_map`` the implicit ``psum`` of a replicated parameter's gradient is inserted at
the point where the replicated value meets the per-device data, which is after the cast, so it
sums 16-bit (and loss-scaled) gradients; under ``jax.jit`` over ``NamedSharding`` inputs the
partitioner all-reduces the weight-gradient matmul's 16-bit output. Two finite per-device fp16
gradients of 40000 then sum to inf and force a skipped step; in bf16 the sum is rounded to 8 bits.
The torch side reduces in fp32.

``cast_to_compute_varying(policy, params, axis_name)`` inside ``shard_map``: it marks the
parameters as varying over the axis *before* the cast (``jax.lax.pcast(..., to="varying")``). The
``psum`` JAX inserts for a replicated parameter then sits at that mark's transpose, on the fp32
gradient: ``jax.grad`` returns the summed fp32 gradient as before, reduced in fp32 (divide by the
axis size for a mean, as without it). Tested from the compiled HLO on two host devices
(tests/jax/multidevice_run.py): the all-reduce is f32 with it and f16 without, and the two per-device
fp16 gradients of 40000 sum to 80000 instead of inf.

Under ``jax.jit`` with ``NamedSharding`` inputs there is no axis to mark: the partitioner places the
all-reduce on the 16-bit gradient (tested); compute the gradient under ``jax.shard_map`` with this
helper to reduce in fp32.
"""

from __future__ import annotations

from typing import Any

import jax

from mixprec.jax.policy import Policy


def cast_to_compute_varying(policy: Policy, tree: Any, axis_name: Any) -> Any:
    """``policy.cast_to_compute(tree)`` for a tree replicated over ``axis_name`` inside ``shard_map``,
    marked varying first so that the gradient's implicit ``psum`` runs on fp32 (module docstring)."""
    if not isinstance(policy, Policy):
        raise TypeError(f"cast_to_compute_varying takes a mixprec.jax Policy first, got {type(policy).__name__}")
    varying = jax.tree_util.tree_map(lambda x: jax.lax.pcast(x, axis_name, to="varying")
                                     if isinstance(x, jax.Array) else x, tree)
    return policy.cast_to_compute(varying)
