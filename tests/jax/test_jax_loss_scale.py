"""mixprec.jax.loss_scale: jmp's semantics, jmp's bugs fixed (checked against jmp where installed), and the
GradScaler extras (ceiling, hysteresis), through jit, vmap and lax.scan."""

import pickle
import warnings

import pytest

pytest.importorskip("jax.numpy")  # a submodule, not "jax": see conftest
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import mixprec.jax as mpj  # noqa: E402

T, F = jnp.bool_(True), jnp.bool_(False)


def _run(ls, pattern):
    for finite in pattern:
        ls = ls.adjust(jnp.bool_(finite))
    return ls


# ---------------------------------------------------------------------------- jmp parity


def test_leaves_are_exactly_loss_scale_and_counter():
    scale, counter = jnp.float32(4.0), jnp.int32(3)
    ls = mpj.DynamicLossScale(scale, counter, period=7, factor=3, min_loss_scale=jnp.float32(0.5))
    assert jax.tree_util.tree_leaves(ls) == [scale, counter]
    assert jax.tree_util.tree_leaves(mpj.NoOpLossScale()) == []
    assert jax.tree_util.tree_leaves(mpj.StaticLossScale(2.0)) == []


def test_defaults_are_jmps():
    ls = mpj.DynamicLossScale(jnp.float32(2.0**15))
    assert (ls.period, ls.factor, float(ls.min_loss_scale), int(ls.counter)) == (2000, 2, 1.0, 0)


def test_grows_by_factor_after_period_finite_steps_and_counter_wraps():
    ls = _run(mpj.DynamicLossScale(jnp.float32(10.0), period=5, factor=3), [True] * 4)
    assert float(ls.loss_scale) == 10.0 and int(ls.counter) == 4
    ls = ls.adjust(T)
    assert float(ls.loss_scale) == 30.0 and int(ls.counter) == 0


def test_shrinks_on_non_finite_to_the_floor_and_resets_counter():
    ls = _run(mpj.DynamicLossScale(jnp.float32(8.0), period=5), [True, True, False])
    assert float(ls.loss_scale) == 4.0 and int(ls.counter) == 0
    assert float(_run(ls, [False] * 10).loss_scale) == 1.0  # jmp's default floor


def test_growth_that_overflows_the_dtype_is_refused():
    ls = _run(mpj.DynamicLossScale(jnp.float32(2.0**127), period=1), [True])
    assert float(ls.loss_scale) == 2.0**127


def test_scale_and_unscale_round_trip():
    for ls in (mpj.StaticLossScale(4.0), mpj.DynamicLossScale(jnp.float32(4.0)), mpj.NoOpLossScale()):
        tree = {"a": jnp.array([1.0, 3.0])}
        assert jnp.array_equal(ls.unscale(ls.scale(tree))["a"], tree["a"])
    noop = mpj.NoOpLossScale()
    assert noop.scale(tree) is tree and noop.adjust(F) is noop and noop.loss_scale == 1


def test_integer_scale_warns_as_jmp():
    with pytest.warns(UserWarning, match="Expected floating type for loss_scale"):
        mpj.DynamicLossScale(jnp.int32(4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mpj.DynamicLossScale(2.0**15)


def test_all_finite_and_select_tree():
    assert bool(mpj.all_finite(None)) and bool(mpj.all_finite({}))
    assert bool(mpj.all_finite({"a": jnp.ones(2), "i": jnp.arange(3)}))
    for bad in (jnp.inf, -jnp.inf, jnp.nan):
        assert not bool(mpj.all_finite({"a": jnp.ones(2), "b": jnp.array([1.0, bad])}))
    a, b = {"x": jnp.ones(2), "n": jnp.int32(1)}, {"x": jnp.zeros(2), "n": jnp.int32(2)}
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(jnp.array_equal, mpj.select_tree(T, a, b), a))
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(jnp.array_equal, mpj.select_tree(F, a, b), b))


def test_select_tree_rejects_non_scalar_predicate_with_an_assertion_error_as_jmp():
    with pytest.raises(AssertionError, match="expected boolean scalar"):
        mpj.select_tree(jnp.ones([1]), None, None)
    with pytest.raises(AssertionError, match="expected boolean scalar"):
        mpj.DynamicLossScale(jnp.float32(2.0)).adjust(jnp.array([True, False]))


# ---------------------------------------------------------------------------- jmp's bugs, fixed


def test_min_loss_scale_survives_jit(impl):
    step = jax.jit(lambda ls: ls.adjust(jnp.bool_(False)))
    ls = impl.loss_scale.DynamicLossScale(jnp.float32(2.0**10), min_loss_scale=jnp.float32(2.0**-10))
    eager = ls
    for _ in range(30):
        ls, eager = step(ls), eager.adjust(F)
    assert float(eager.loss_scale) == 2.0**-10
    assert float(ls.loss_scale) == 2.0**-10  # jmp: 1.0, its default floor, after the first jit boundary


def test_min_loss_scale_survives_scan_and_flatten(impl):
    ls = impl.loss_scale.DynamicLossScale(jnp.float32(2.0**10), min_loss_scale=jnp.float32(2.0**-10))
    out, _ = jax.lax.scan(lambda s, _: (s.adjust(jnp.bool_(False)), None), ls, None, length=30)
    assert float(out.loss_scale) == 2.0**-10
    leaves, treedef = jax.tree_util.tree_flatten(ls)
    assert float(jax.tree_util.tree_unflatten(treedef, leaves).min_loss_scale) == 2.0**-10


def test_float16_loss_scale_adjusts_and_keeps_its_dtype(impl):
    ls = impl.loss_scale.DynamicLossScale(jnp.float16(2.0**15), period=1)
    down = ls.adjust(jnp.bool_(False))
    assert down.loss_scale.dtype == jnp.float16 and float(down.loss_scale) == 2.0**14
    up = ls.adjust(jnp.bool_(True))
    assert up.loss_scale.dtype == jnp.float16 and float(up.loss_scale) == 2.0**15  # 2^16 is inf in f16: refused


def test_select_tree_accepts_python_bools(impl):
    assert float(impl.loss_scale.select_tree(True, {"a": jnp.float32(1)}, {"a": jnp.float32(2)})["a"]) == 1.0


def test_select_tree_names_the_leaf_whose_dtypes_differ(impl):
    with pytest.raises(TypeError, match=r"\['w'\].*bfloat16.*float32"):
        impl.loss_scale.select_tree(T, {"w": jnp.ones(2, jnp.bfloat16)}, {"w": jnp.ones(2)})


def test_static_loss_scale_from_a_traced_value_is_refused_not_leaked(impl):
    with pytest.raises(TypeError, match="concrete"):
        jax.jit(lambda s: impl.loss_scale.StaticLossScale(s))(jnp.float32(4.0))


def test_vmapped_decision_is_shared_with_axis_name():
    """flax#4114's failure: per-example decisions split one scale into many. All-reduced, it stays one."""
    ls = mpj.DynamicLossScale(jnp.float32(4.0))
    grads = jnp.array([1.0, jnp.inf, 2.0])
    split = jax.vmap(lambda g: ls.adjust(mpj.all_finite(g)))(grads)
    assert split.loss_scale.tolist() == [4.0, 2.0, 4.0]
    shared = jax.vmap(lambda g: ls.adjust(mpj.all_finite(g, axis_name="batch")), axis_name="batch")(grads)
    assert shared.loss_scale.tolist() == [2.0, 2.0, 2.0]


# ---------------------------------------------------------------------------- beyond jmp: ceiling, hysteresis


def test_ceiling_caps_growth():
    ls = _run(mpj.DynamicLossScale(jnp.float32(2.0**14), period=1, max_loss_scale=2.0**15), [True] * 3)
    assert float(ls.loss_scale) == 2.0**15


def test_hysteresis_lowers_only_after_that_many_overflows_and_refills_on_growth():
    ls = mpj.DynamicLossScale(jnp.float32(2.0**10), period=3, hysteresis=2)
    assert len(jax.tree_util.tree_leaves(ls)) == 3  # the remaining budget is state
    seen = []
    for finite in [False, False, False, True, True, True, False]:
        ls = ls.adjust(jnp.bool_(finite))
        seen.append((float(ls.loss_scale), int(ls.hysteresis_left)))
    # tolerated, lowered, lowered again (budget stays spent), three clean steps grow and refill, tolerated
    assert seen == [(1024, 1), (512, 1), (256, 1), (256, 1), (256, 1), (512, 2), (512, 1)]


def test_consecutive_hysteresis_refills_on_every_clean_step():
    ls = mpj.DynamicLossScale(jnp.float32(2.0**10), hysteresis=2, consecutive_hysteresis=True)
    ls = _run(ls, [False, True, False, True, False])
    assert float(ls.loss_scale) == 2.0**10  # never two overflows in a row
    assert float(_run(ls, [False]).loss_scale) == 2.0**9


def test_config_survives_jit_and_matches_eager():
    ls = mpj.DynamicLossScale(jnp.float32(2.0**4), period=2, max_loss_scale=2.0**6, hysteresis=2, min_loss_scale=jnp.float32(2.0))
    pattern = [True] * 6 + [False] * 7 + [True]
    step = jax.jit(lambda s, f: s.adjust(f))
    jitted = ls
    for f in pattern:
        jitted = step(jitted, jnp.bool_(f))
    eager = _run(ls, pattern)
    assert [np.asarray(x).item() for x in jax.tree_util.tree_leaves(jitted)] == \
           [np.asarray(x).item() for x in jax.tree_util.tree_leaves(eager)]
    assert float(eager.loss_scale) == 2.0  # grew to the ceiling 2^6, one overflow tolerated, then down to the floor


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"hysteresis": 0}, "hysteresis"),
        ({"factor": 1}, "factor"),
        ({"period": 0}, "period"),
        ({"max_loss_scale": 0.5}, "below min_loss_scale"),
        ({"max_loss_scale": 2.0}, "above max_loss_scale"),
    ],
)
def test_bad_configuration_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mpj.DynamicLossScale(jnp.float32(4.0), **kwargs)


def test_loss_scales_pickle():
    ls = mpj.DynamicLossScale(jnp.float32(8.0), min_loss_scale=jnp.float32(0.25), hysteresis=2)
    back = pickle.loads(pickle.dumps(ls))
    assert float(back.min_loss_scale) == 0.25 and back.hysteresis == 2
    assert float(_run(back, [False] * 8).loss_scale) == float(_run(ls, [False] * 8).loss_scale) == 0.25


@pytest.mark.parametrize("hysteresis, consecutive", [(1, False), (2, False), (3, True)])
def test_same_scales_as_the_torch_sides_grad_scaler_on_random_overflows(hysteresis, consecutive):
    """DynamicLossScale with a floor, a ceiling and hysteresis against mixprec.GradScaler, step for step."""
    import random

    import torch

    import mixprec

    rng = random.Random(hysteresis * 10 + consecutive)
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    torch_side = mixprec.GradScaler("cpu", init_scale=2.0**10, growth_interval=3, hysteresis=hysteresis,
                                    consecutive_hysteresis=consecutive, min_scale=2.0**4, max_scale=2.0**14, on_floor="skip")
    ls = mpj.DynamicLossScale(jnp.float32(2.0**10), period=3, min_loss_scale=jnp.float32(2.0**4), max_loss_scale=2.0**14,
                              hysteresis=hysteresis, consecutive_hysteresis=consecutive)
    for step in range(300):
        overflow = rng.random() < 0.3
        torch_side.scale((w * 2.0).sum()).backward()
        if overflow:
            w.grad[0] = float("inf")
        torch_side.step(opt)
        torch_side.update()
        opt.zero_grad(set_to_none=True)
        ls = ls.adjust(jnp.bool_(not overflow))
        assert float(ls.loss_scale) == torch_side.get_scale(), f"step {step}"


def test_a_batch_of_scales_with_a_ceiling_is_checked_per_element():
    import jax

    scales = mpj.DynamicLossScale(jnp.full((3,), 8.0), counter=jnp.zeros((3,), jnp.int32), max_loss_scale=2.0**10)
    out = jax.vmap(lambda s, f: s.adjust(f))(scales, jnp.array([True, False, True]))
    assert out.loss_scale.tolist() == [8.0, 4.0, 8.0]
    with pytest.raises(ValueError, match=r"loss_scale \(\[8.0, 4096.0\]\) is above max_loss_scale"):
        mpj.DynamicLossScale(jnp.array([8.0, 4096.0]), max_loss_scale=2.0**10)


def test_equal_configurations_share_one_aux_object_and_the_treedef_text_is_unchanged():
    """jit compares and hashes the argument treedefs at every call: a DynamicLossScale's aux data is one interned
    object per configuration, so equal configurations give equal treedefs by identity and a different floor, dtype
    or hysteresis gives a different treedef. The text (which checkpoints store and compare) is the plain tuple's."""
    def aux(ls):
        return jax.tree_util.tree_structure(ls).node_data()[1]

    a = mpj.DynamicLossScale(jnp.float32(4.0), min_loss_scale=jnp.float32(0.5))
    b = mpj.DynamicLossScale(jnp.float32(1024.0), jnp.int32(7), min_loss_scale=np.float32(0.5))
    assert aux(a) is aux(b)
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    assert aux(jax.jit(lambda s: s.adjust(jnp.bool_(True)))(a)) is aux(a)
    for other in (mpj.DynamicLossScale(jnp.float32(4.0), min_loss_scale=jnp.float32(0.25)),
                  mpj.DynamicLossScale(jnp.float32(4.0), min_loss_scale=jnp.float16(0.5)),
                  mpj.DynamicLossScale(jnp.float32(4.0), min_loss_scale=jnp.float32(0.5), hysteresis=2)):
        assert jax.tree_util.tree_structure(other) != jax.tree_util.tree_structure(a)
    assert str(jax.tree_util.tree_structure(a)) == \
        "PyTreeDef(CustomNode(DynamicLossScale[(2000, 2, 0.5, None, 1, False)], [*, *]))"
    assert tuple(aux(a)) == (2000, 2, aux(a)[2], None, 1, False)


def test_treedefs_pickle_and_a_plain_tuple_aux_still_unflattens():
    ls = mpj.DynamicLossScale(jnp.float32(8.0), min_loss_scale=jnp.float32(0.25), hysteresis=3, max_loss_scale=2.0**10)
    leaves, treedef = jax.tree_util.tree_flatten(ls)
    back = pickle.loads(pickle.dumps(treedef))
    assert back == treedef
    rebuilt = back.unflatten(leaves)
    assert (rebuilt.hysteresis, float(rebuilt.min_loss_scale), float(rebuilt.max_loss_scale)) == (3, 0.25, 2.0**10)
    # the aux data as a tuple (its form before it was interned) rebuilds the same configuration
    from mixprec.jax.loss_scale import DynamicLossScale as cls
    old_style = cls.tree_unflatten(tuple(treedef.node_data()[1]), leaves)
    assert jax.tree_util.tree_structure(old_style) == treedef
    assert float(_run(old_style, [False] * 8).loss_scale) == float(_run(ls, [False] * 8).loss_scale) == 0.25


def test_leafless_scales_share_one_aux_object_keep_their_treedef_text_and_pickle():
    def aux(ls):
        return jax.tree_util.tree_structure(ls).node_data()[1]

    assert aux(mpj.NoOpLossScale()) is aux(mpj.NoOpLossScale())
    assert aux(mpj.StaticLossScale(2.0**10)) is aux(mpj.StaticLossScale(2.0**10))
    assert aux(mpj.StaticLossScale(2.0**10)) is not aux(mpj.StaticLossScale(2.0**11))
    assert aux(mpj.StaticLossScale(np.float32(2.0**10))) is not aux(mpj.StaticLossScale(2.0**10))  # dtype counts
    assert str(jax.tree_util.tree_structure(mpj.NoOpLossScale())) == "PyTreeDef(CustomNode(NoOpLossScale[NoOpLossScale()], []))"
    assert str(jax.tree_util.tree_structure(mpj.StaticLossScale(2.0**10))) == "PyTreeDef(CustomNode(StaticLossScale[1024.0], []))"
    for ls in (mpj.NoOpLossScale(), mpj.StaticLossScale(2.0**10)):
        treedef = jax.tree_util.tree_structure(ls)
        back = pickle.loads(pickle.dumps(treedef))
        assert back == treedef and back.unflatten([]) == ls
        assert pickle.loads(pickle.dumps(ls)) == ls
        rebuilt = jax.jit(lambda s: s)(ls)
        assert type(rebuilt) is type(ls) and rebuilt == ls
    assert float(jax.jit(lambda s: s.scale(jnp.float32(3.0)))(mpj.StaticLossScale(2.0**10))) == 3072.0
    # the aux of a treedef pickled before it was interned (a _Static) still unflattens
    from mixprec.jax.loss_scale import _static, _static_unflatten
    assert float(_static_unflatten(_static(2.0**3, "StaticLossScale", "loss_scale"), ()).loss_scale) == 8.0


def test_configurations_nobody_holds_are_not_kept():
    """The interned aux objects live as long as a loss scale, treedef or jit cache holds them: a loop that builds
    a StaticLossScale per value (a hand-made schedule) does not grow a table without bound."""
    import gc

    from mixprec.jax import loss_scale as L

    held = mpj.StaticLossScale(2.0**10)
    held_aux = jax.tree_util.tree_structure(held).node_data()[1]
    before = len(L._STATIC_AUX), len(L._CONFIGS)
    for i in range(2000):
        s = mpj.StaticLossScale(1.0 + i / 4096)
        jax.tree_util.tree_structure(s)
        d = mpj.DynamicLossScale(jnp.float32(4.0), period=10 + i)
        jax.tree_util.tree_structure(d)
    del s, d
    gc.collect()
    assert len(L._STATIC_AUX) <= before[0] + 1 and len(L._CONFIGS) <= before[1] + 1
    assert jax.tree_util.tree_structure(mpj.StaticLossScale(2.0**10)).node_data()[1] is held_aux  # still interned


# ---------------------------------------------------------------------------- found by a probe of the JAX side


@pytest.mark.parametrize("make", [lambda: mpj.StaticLossScale(2 ** 15), lambda: mpj.StaticLossScale(2.0 ** 15),
                                  lambda: mpj.DynamicLossScale(2.0 ** 15), lambda: mpj.DynamicLossScale(jnp.asarray(2.0 ** 15))],
                         ids=["static-int", "static-float", "dynamic-float", "dynamic-weak-array"])
def test_a_python_number_scale_unscales_fp16_gradients_in_fp32(make):
    # jmp's own spelling, StaticLossScale(2 ** 15): the reciprocal was weakly typed, took the gradients' fp16, and a
    # true gradient of 2**-26 (2**-11 once scaled, fine in fp16) came out 0
    ls = make()
    g = {"w": jnp.asarray([2.0 ** -11], jnp.float16)}
    out = ls.unscale(g)["w"]
    assert out.dtype == jnp.float32 and float(out[0]) == 2.0 ** -26
    out = jax.jit(lambda s, g: s.unscale(g))(ls, g)["w"]  # a weak leaf under jit: the same
    assert out.dtype == jnp.float32 and float(out[0]) == 2.0 ** -26
    loss = jnp.float16(3.0)  # 3 * 2**15 overflows fp16: the scaled loss is float32
    assert ls.scale(loss).dtype == jnp.float32 and float(ls.scale(loss)) == 3.0 * 2 ** 15


def test_a_fixed_type_scale_keeps_jax_promotion():
    g = jnp.asarray([2.0], jnp.float16)
    assert mpj.StaticLossScale(jnp.float16(2.0)).unscale(g).dtype == jnp.float16  # an fp16 scale was asked for
    assert mpj.DynamicLossScale(jnp.float32(2.0)).unscale(g).dtype == jnp.float32


def test_a_floor_the_scale_dtype_cannot_hold_is_refused():
    # an fp16 scale with a floor of 2**-30: the floor cast to fp16 is 0, the scale fell to 0 after 30 overflows
    # and every later step was skipped (unscaling by 1/0), with no error
    with pytest.raises(ValueError, match=r"min_loss_scale .* is 0\.0 in the scale's dtype float16"):
        mpj.DynamicLossScale(jnp.float16(16.0), min_loss_scale=np.float32(2.0 ** -30))
    ls = mpj.DynamicLossScale(jnp.float16(16.0), min_loss_scale=np.float32(2.0 ** -24))  # fp16's smallest: kept
    for _ in range(40):
        ls = ls.adjust(F)
    assert float(ls.loss_scale) == 2.0 ** -24


def test_a_scale_below_its_floor_is_refused():
    # an overflow moved such a scale up, to the floor
    with pytest.raises(ValueError, match=r"loss_scale \(1\.0\) is below min_loss_scale \(4\.0\)"):
        mpj.DynamicLossScale(jnp.float32(1.0), min_loss_scale=jnp.float32(4.0))
    with pytest.raises(ValueError, match="below min_loss_scale"):
        mpj.DynamicLossScale(jnp.asarray([8.0, 0.5], jnp.float32))  # the default floor is 1


def test_period_must_be_a_whole_number_of_steps():
    ls = mpj.DynamicLossScale(jnp.float32(4.0), period=4.0)  # an integral float is taken as the int it is
    assert type(ls.period) is int
    out, _ = jax.lax.scan(lambda s, _: (s.adjust(T), None), ls, None, length=5)  # the int32 counter stays int32
    assert out.counter.dtype == jnp.int32 and int(out.counter) == 1 and float(out.loss_scale) == 8.0
    for bad in (2.5, 0, -3, True, "10"):
        with pytest.raises(ValueError, match="whole, positive number of steps"):
            mpj.DynamicLossScale(jnp.float32(4.0), period=bad)
