"""mixprec.jax.audit: each kind of finding on the step that has it, with its source line, and nothing on a clean
step (16-bit matmuls, the clip inside skip_nonfinite, an fp8 dot)."""

import inspect

import numpy as np
import pytest

pytest.importorskip("jax.numpy")  # a submodule, not "jax": see conftest
pytest.importorskip("optax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import mixprec.jax as mpj  # noqa: E402
from mixprec.jax.auditing_hlo import hlo_collectives  # noqa: E402

POLICY = mpj.get_policy("p=f32,c=bf16,o=f32")
X, Y = jnp.ones((8, 16)), jnp.zeros((8, 16))
PARAMS = {"a": jnp.ones((16, 32)) / 4, "b": jnp.ones((32, 16)) / 4}


def _line(fn, text):
    src, start = inspect.getsourcelines(fn)
    return f"test_jax_audit.py:{start + next(i for i, ln in enumerate(src) if text in ln)}"


def _step(tx, forward):
    def step(params, opt_state, x, y):
        ls = mpj.loss_scale_of(opt_state)
        grads = jax.grad(lambda p: ls.scale(jnp.mean((forward(p, x) - y) ** 2)))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state
    return step


def clean_forward(p, x):
    pc, xc = POLICY.cast_to_compute((p, x))
    return POLICY.cast_to_output(jax.nn.relu(xc @ pc["a"]) @ pc["b"])


def undone_forward(p, x):
    pc, xc = POLICY.cast_to_compute((p, x))
    h = jax.nn.relu(xc @ pc["a"]).astype(jnp.float32)   # the bf16 activation widened back to f32
    return h @ pc["b"]                                   # promotes the bf16 kernel: an f32 matmul


def uncast_forward(p, x):
    pc, xc = POLICY.cast_to_compute((p, x))
    skip = x @ p["c"]   # x and p, not xc and pc: never cast
    return POLICY.cast_to_output(jax.nn.relu(xc @ pc["a"]) @ pc["b"]) + skip


def test_a_clean_bf16_step_has_no_findings():
    tx = mpj.skip_nonfinite(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)), "bf16-mixed")
    report = mpj.audit(_step(tx, clean_forward), PARAMS, tx.init(PARAMS), X, Y)
    assert report.ok, str(report)
    assert report.compute_dtype == "bfloat16" and len(report.dots) == 5  # 2 forward, 3 backward (none for x)
    assert {(d.lhs, d.rhs) for d in report.dots} == {("bfloat16", "bfloat16")}
    assert "5 x bfloat16 x bfloat16" in str(report)


def test_an_undone_cast_is_found_at_the_line_that_widened():
    tx = mpj.skip_nonfinite(optax.adam(1e-3), "bf16-mixed")
    report = mpj.audit(_step(tx, undone_forward), PARAMS, tx.init(PARAMS), X, Y)
    (f,) = report.by_kind("undone-cast")
    assert _line(undone_forward, "widened back") in f.message  # where the cast was undone
    assert _line(undone_forward, "promotes the bf16") in f.where  # the f32 matmul
    assert not report.by_kind("f32-matmul")


def test_an_uncast_layer_is_an_f32_matmul_under_the_policy():
    tx = mpj.skip_nonfinite(optax.adam(1e-3), "bf16-mixed")
    params = {**PARAMS, "c": jnp.eye(16)}
    report = mpj.audit(_step(tx, uncast_forward), params, tx.init(params), X, Y, policy="bf16-mixed")
    (f,) = report.by_kind("f32-matmul")
    assert _line(uncast_forward, "never cast") in f.where and "under a bfloat16 policy" in f.message


def test_a_clip_before_the_unscaling_is_found():
    def step(params, ls, x, y):  # jmp style, clip first
        grads = jax.grad(lambda p: ls.scale(jnp.mean((clean_forward(p, x) - y) ** 2)))(params)
        grads, _ = optax.clip_by_global_norm(1.0).update(grads, None)
        return ls.unscale(grads)

    report = mpj.audit(step, PARAMS, mpj.DynamicLossScale(jnp.float32(2.0**15)), X, Y)
    (f,) = report.by_kind("clip-before-unscale")
    assert "norm of a loss-scaled gradient" in f.message and "_clipping.py" in f.where
    assert _line(step, "clip_by_global_norm(1.0).update") in f.where
    clipped_later = mpj.audit(lambda p, ls, x, y: optax.clip_by_global_norm(1.0).update(
        ls.unscale(jax.grad(lambda q: ls.scale(jnp.mean((clean_forward(q, x) - y) ** 2)))(p)), None)[0],
        PARAMS, mpj.DynamicLossScale(jnp.float32(2.0**15)), X, Y)
    assert clipped_later.ok, str(clipped_later)


def test_a_16_bit_psum_is_found_and_the_fp32_pattern_is_clean():
    from jax.sharding import Mesh, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:1]), ("d",))
    policy = mpj.get_policy("p=f32,c=f16,o=f32")

    def grads(varying):
        def local(p, x):
            def loss(q):
                qc = mpj.cast_to_compute_varying(policy, q, "d") if varying else policy.cast_to_compute(q)
                return jnp.sum(policy.cast_to_output(policy.cast_to_compute(x) @ qc["a"]))
            return jax.grad(loss)(p)
        return jax.shard_map(local, mesh=mesh, in_specs=(P(), P("d")), out_specs=P())

    bad = mpj.audit(grads(False), {"a": PARAMS["a"]}, X, compiled=False)
    (f,) = bad.by_kind("16-bit-collective")
    assert "float16" in f.message and "cast_to_compute_varying" in f.message
    assert not mpj.audit(grads(True), {"a": PARAMS["a"]}, X, compiled=False).by_kind("16-bit-collective")


def test_a_16_bit_sum_is_found():
    """A bias added in bf16: its gradient is the output gradient summed over the batch, in bf16 (jnp.sum itself
    sums bf16 in f32, and is not reported)."""
    def loss(b, x):
        return jnp.sum((x.astype(jnp.bfloat16) + b.astype(jnp.bfloat16)).astype(jnp.float32) ** 2)

    report = mpj.audit(jax.grad(loss), jnp.ones(16), X, compiled=False)
    (f,) = report.findings
    assert f.kind == "16-bit-reduction" and "backward pass" in f.message and _line(loss, "b.astype") in f.where
    assert mpj.audit(lambda x: jnp.sum(x.astype(jnp.bfloat16)), X, compiled=False).ok
    assert [f.kind for f in mpj.audit(lambda x: jnp.cumsum(x.astype(jnp.bfloat16)), X, compiled=False).findings] == [
        "16-bit-reduction"]


def test_an_fp8_dot_is_reported_as_fp8_not_as_an_f32_matmul():
    from mixprec.jax import fp8

    dot = fp8.Fp8DotGeneral(fp8.config_for("fp8-current"))
    fwd = lambda w, x: jnp.sum(dot(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), (((1,), (0,)), ((), ()))))  # noqa: E731
    report = mpj.audit(jax.grad(fwd), PARAMS["a"], X, policy="bf16-mixed", compiled=False)
    assert report.ok, str(report)
    assert {d.carried for d in report.dots} >= {("float8_e4m3fn", "float8_e4m3fn")}


def test_nnx_linear_with_dtype_none_undoes_the_policy_cast():
    nnx = pytest.importorskip("flax.nnx")
    model = nnx.Linear(16, 16, rngs=nnx.Rngs(0))       # dtype=None: computes in its inputs' dtype
    graphdef, state = nnx.split(model)

    def loss(state, x):
        layer = nnx.merge(graphdef, POLICY.cast_to_compute(state))  # the kernel in bf16...
        return jnp.sum(layer(x))                                     # ...x in f32: promoted to f32

    report = mpj.audit(jax.grad(loss), state, X, policy="bf16-mixed", compiled=False)
    (f,) = report.by_kind("undone-cast")
    assert "linear.py" in f.where and _line(loss, "promoted to f32") in f.where


def test_hlo_collectives_read_dtypes_and_stack_frames():
    text = "\n".join([
        "HloModule m", "", "FileNames", '1 "/home/u/train.py"', "", "FunctionNames", '1 "step"', "",
        "FileLocations", "1 {file_name_id=1 function_name_id=1 line=42 end_line=42 column=1 end_column=9}", "",
        "StackFrames", "1 {file_location_id=1 parent_frame_id=1}", "",
        "%ar = bf16[4,2]{1,0} all-reduce(bf16[4,2]{1,0} %x), replica_groups={}, to_apply=%sum, "
        "metadata={op_name=\"x\" stack_frame_id=1}",
        "%ar2 = (f32[2]{0}, s32[]) all-reduce(%y, %z), to_apply=%sum",
    ])
    assert hlo_collectives(text) == [("bf16", "all-reduce", "/home/u/train.py:42 (step)"), ("f32", "all-reduce", "unknown")]
