"""Run by test_jax_multidevice.py in a subprocess with two host devices (XLA_FLAGS must be set before jax
starts). Prints one JSON object of observations."""

import json
import os
import sys

assert "--xla_force_host_platform_device_count=2" in os.environ.get("XLA_FLAGS", ""), "run me with 2 host devices"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import mixprec.jax as mpj  # noqa: E402

out = {"devices": jax.device_count()}
W = jnp.asarray(np.arange(8, dtype=np.float32).reshape(2, 4) / 8)


def make(axis_name):
    return mpj.skip_nonfinite(optax.sgd(0.5), mpj.DynamicLossScale(jnp.float32(2.0**10)), axis_name=axis_name)


def step_fn(tx, reduce_grads):
    def step(params, state, poison):
        ls = mpj.loss_scale_of(state)
        grads = jax.grad(lambda p: ls.scale(jnp.sum(p["w"] ** 2)) * poison)(params)
        if reduce_grads:
            grads = jax.lax.pmean(grads, "d")
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state
    return step


def replicate(tree):
    return jax.tree_util.tree_map(lambda x: jnp.stack([jnp.asarray(x)] * 2), tree)


# pmap: one replica's gradients overflow (poison = inf on device 1 only)
poison = jnp.asarray([1.0, jnp.inf], jnp.float32)
for label, axis, reduce in (("pmap_shared", "d", False), ("pmap_local", None, False), ("pmap_pmean", None, True)):
    tx = make(axis)
    params = replicate({"w": W})
    state = replicate(tx.init({"w": W}))
    params, state = jax.pmap(step_fn(tx, reduce), axis_name="d")(params, state, poison)
    out[label] = {
        "skipped": np.asarray(state.last_skipped).tolist(),
        "scale": np.asarray(state.loss_scale.loss_scale).tolist(),
        "params_equal_across_devices": bool(np.array_equal(np.asarray(params["w"][0]), np.asarray(params["w"][1]))),
        "params_unchanged": [bool(np.array_equal(np.asarray(params["w"][i]), np.asarray(W))) for i in range(2)],
    }

# shard_map: the parameter is split over the devices, each holds half its gradient
mesh = Mesh(np.array(jax.devices()), ("d",))
for label, axis in (("shard_map_shared", "d"), ("shard_map_local", None)):
    tx = make(axis)

    def local(params, state, poison):
        ls = mpj.loss_scale_of(state)
        grads = jax.grad(lambda p: ls.scale(jnp.sum(p["w"] ** 2)) * poison[0])(params)
        updates, state = tx.update(grads, state, params)
        # per-device views of the decision, stacked over the devices
        return optax.apply_updates(params, updates), state.last_skipped[None], state.loss_scale.loss_scale[None]

    state0 = tx.init({"w": W})
    state_spec = jax.tree_util.tree_map(lambda _: P(), state0)
    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=({"w": P("d")}, state_spec, P("d")),
                              out_specs=({"w": P("d")}, P("d"), P("d")), check_vma=False))
    params, skipped, scale = f({"w": W}, state0, poison)
    out[label] = {"skipped": np.asarray(skipped).tolist(), "scale": np.asarray(scale).tolist(),
                  "params_unchanged": bool(np.array_equal(np.asarray(params["w"]), np.asarray(W)))}

# jit over a sharded array (GSPMD): the global all_finite is already global, no axis_name needed
sharding = NamedSharding(mesh, P("d"))
tx = make(None)
params = {"w": jax.device_put(W, sharding)}
state = tx.init(params)
bad = jax.device_put(jnp.asarray([[1.0] * 4, [1.0, 1.0, jnp.inf, 1.0]]), sharding)
step = jax.jit(lambda p, s, m: tx.update(jax.tree_util.tree_map(lambda g: g * m, {"w": 2 * p["w"]}), s, p))
updates, state = step(params, state, bad)
out["gspmd"] = {"skipped": bool(state.last_skipped), "scale": float(state.loss_scale.loss_scale),
                "params_unchanged": bool(np.array_equal(np.asarray(optax.apply_updates(params, updates)["w"]), np.asarray(W)))}


# the gradient all-reduce's dtype, from the compiled HLO: fp32 replicated params, batch split over "d", fp16 compute
import re  # noqa: E402


def all_reduce_dtypes(compiled):
    return sorted(set(re.findall(r"= (\w+)\[[^\]]*\][^ ]* all-reduce\(", compiled.as_text())))


policy = mpj.get_policy("p=f32,c=f16,o=f32")
xb = jnp.asarray(np.ones((4, 4), np.float32))
# per-device scaled gradients of 40000 each: fine in fp16 alone, inf when summed in fp16 (65504 is its max)
yb = jnp.asarray(np.zeros((4, 2), np.float32))
w0 = {"w": jnp.full((4, 2), 1.0, jnp.float32)}


def dp_grads(fp32_reduce):
    def local(params, x, y):
        def loss(p):
            pc = mpj.cast_to_compute_varying(policy, p, "d") if fp32_reduce else policy.cast_to_compute(p)
            out = policy.cast_to_output(policy.cast_to_compute(x) @ pc["w"])
            return jnp.sum((out - y) ** 2) * 2500.0  # d/dw per device: 2 rows * 2 * 4 * 2500 = 40000 per entry
        return jax.grad(loss)(params)  # summed over the devices by the psum JAX inserts (the pcast's transpose)
    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P("d"), P("d")), out_specs=P()))


for label, fp32_reduce in (("reduce_compute_dtype", False), ("reduce_fp32", True)):
    f = dp_grads(fp32_reduce)
    g = f(w0, xb, yb)
    out[label] = {"all_reduce": all_reduce_dtypes(f.lower(w0, xb, yb).compile()),
                  "grad": float(np.asarray(g["w"]).max()), "finite": bool(np.isfinite(np.asarray(g["w"])).all())}

# jit over NamedSharding inputs, the same cast inside: XLA's partitioner all-reduces the 16-bit gradient
xs, ys = jax.device_put(xb, NamedSharding(mesh, P("d"))), jax.device_put(yb, NamedSharding(mesh, P("d")))
gj = jax.jit(jax.grad(lambda p, x, y: jnp.sum((policy.cast_to_output(policy.cast_to_compute(x) @ policy.cast_to_compute(p)["w"])
                                              - y) ** 2) * 2500.0))
out["jit_named_sharding"] = {"all_reduce": all_reduce_dtypes(gj.lower(w0, xs, ys).compile())}
report = mpj.audit(gj, w0, xs, ys)
out["audit_jit"] = {"kinds": [f.kind for f in report.findings], "where": [f.where for f in report.findings],
                    "collectives": report.collectives}
report = mpj.audit(dp_grads(True), w0, xb, yb)
out["audit_fp32_reduce"] = {"kinds": [f.kind for f in report.findings], "collectives": report.collectives}

# a checkpoint of a sharded leaf loads back across the devices `like` spans (it came back on device 0)
import tempfile  # noqa: E402

with tempfile.TemporaryDirectory() as tmp:
    row = NamedSharding(mesh, P("d"))
    w = jax.device_put(jnp.arange(8.0).reshape(4, 2), row)
    try:  # a failure here is reported by its own test, not by every test of this run
        mpj.save_tree(os.path.join(tmp, "s.npz"), {"w": w, "k": jax.random.key(1)})
        back = mpj.load_tree(os.path.join(tmp, "s.npz"), {"w": jax.device_put(jnp.zeros((4, 2)), row), "k": jax.random.key(0)})
        out["checkpoint_sharded"] = {"same_sharding": back["w"].sharding == row, "equal": bool(np.array_equal(back["w"], w)),
                                     "devices": len(back["w"].sharding.device_set)}
    except Exception as e:  # noqa: BLE001
        out["checkpoint_sharded"] = {"error": f"{type(e).__name__}: {e}"}

json.dump(out, sys.stdout)
