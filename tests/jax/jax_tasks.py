"""Tiny JAX tasks for the compare tests (named as --task jax_tasks:make_task; tests/jax is on sys.path)."""

import numpy as np

import jax.numpy as jnp
import optax

from mixprec.jax import JaxTask

W_TRUE = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)


def make_task(kind: str = "linear", steps: int = 40) -> JaxTask:
    """``linear``: a noisy linear teacher, fine in every precision. ``overflow16``: the forward passes
    through ~9 x 10^4 (past fp16's 65504: NON-FINITE in fp16, fine in bf16). ``cancel``: adds and removes
    2^12 in the compute dtype, which rounds the prediction to bf16's step of 32 there (DIVERGES in bf16).
    ``offset1000``: targets near 1000, predicted as ``x @ w + b`` with ``b`` learned from 1000: bf16's
    spacing there is 4, so a bf16 prediction is off by up to 2 (a loss floor of ~1.3 against fp32's ~0.09);
    the rounding sits in one add that XLA's CPU excess precision would silently keep in f32."""

    if kind == "mlp":
        return _mlp(steps)

    def get_batch(step):
        rng = np.random.default_rng(100 + step)
        x = rng.standard_normal((32, 8)).astype(np.float32)
        noise = 0.3 * rng.standard_normal((32, 4)).astype(np.float32)  # a loss floor of ~0.09 that 16 bits resolve
        return x, x @ W_TRUE + noise + (1000.0 if kind == "offset1000" else 0.0)

    def init_params(key):
        seed = int(np.asarray(key).sum())  # PRNGKey(seed) holds [0, seed]: a numpy draw needs no jax compile
        params = {"w": jnp.asarray(0.3 * np.random.default_rng(seed).standard_normal((8, 4)), jnp.float32)}
        if kind == "offset1000":
            params["b"] = jnp.full((4,), 1000.0, jnp.float32)
        return params

    def apply(params, x, recipe):
        h = x @ params["w"]
        if kind == "overflow16":
            big = (h + 1.0) * 300.0 * 300.0  # 9e4 at h = 0: inf in fp16
            return big * (1 / 300.0) * (1 / 300.0) - 1.0
        if kind == "offset1000":
            return h + params["b"]
        if kind == "cancel":
            c = jnp.asarray(4096.0, h.dtype)
            return (h + c) - c
        return h

    return JaxTask(
        name=f"tiny-{kind}",
        init_params=init_params,
        get_batch=get_batch,
        apply=apply,
        loss_fn=lambda out, y: jnp.mean((out - y) ** 2),
        make_optimizer=lambda: optax.adam(0.05),
        steps=steps,
        description=f"tiny linear regression ({kind})",
    )


def _mlp(steps):
    """Three dense layers multiplied through ``recipe.matmul`` (16 -> 32 -> 32 -> 16): under an fp8 recipe
    the middle one computes in fp8 (the first and last stay bf16, the torch side's rule)."""
    w_true = np.random.default_rng(1).standard_normal((16, 16)).astype(np.float32) / 4

    def get_batch(step):
        rng = np.random.default_rng(200 + step)
        x = rng.standard_normal((32, 16)).astype(np.float32)
        return x, np.tanh(x @ w_true) + 0.05 * rng.standard_normal((32, 16)).astype(np.float32)

    def init_params(key):
        rng = np.random.default_rng(int(np.asarray(key).sum()))
        shapes = {"a": (16, 32), "b": (32, 32), "c": (32, 16)}
        return {k: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[0]), jnp.float32) for k, s in shapes.items()}

    def apply(params, x, recipe):
        h = jnp.tanh(recipe.matmul(x, params["a"]))
        h = jnp.tanh(recipe.matmul(h, params["b"]))
        return recipe.matmul(h, params["c"])

    return JaxTask(name="tiny-mlp", init_params=init_params, get_batch=get_batch, apply=apply,
                   loss_fn=lambda out, y: jnp.mean((out - y) ** 2), make_optimizer=lambda: optax.adam(0.02),
                   steps=steps, description="tiny 3-layer MLP through recipe.matmul")
