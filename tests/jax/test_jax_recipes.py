"""mixprec.jax.recipes: the torch side's names resolve to a policy plus a loss scale."""

import pytest

pytest.importorskip("jax.numpy")  # a submodule, not "jax": see conftest
import jax.numpy as jnp  # noqa: E402

import mixprec  # noqa: E402
import mixprec.jax as mpj  # noqa: E402


@pytest.mark.parametrize(
    "name, policy, scale, master",
    [
        ("fp32", "p=full,c=full,o=full", mpj.NoOpLossScale, "none"),
        ("bf16-mixed", "p=full,c=bf16,o=full", mpj.NoOpLossScale, "none"),
        ("fp16-mixed", "p=full,c=f16,o=full", mpj.DynamicLossScale, "none"),
        ("bf16-true", "p=bf16,c=bf16,o=full", mpj.NoOpLossScale, "fp32"),
        ("fp16-true", "p=f16,c=f16,o=full", mpj.DynamicLossScale, "fp32"),
        ("16-mixed", "p=full,c=f16,o=full", mpj.DynamicLossScale, "none"),  # the torch side's aliases too
        ("p=f32,c=bf16,o=f32", "p=full,c=bf16,o=full", mpj.NoOpLossScale, "none"),
        ("p=f32, c=F16", "p=full,c=f16,o=f16", mpj.DynamicLossScale, "none"),
    ],
)
def test_names_resolve_to_policy_and_loss_scale(name, policy, scale, master):
    r = mpj.get_recipe(name)
    assert str(r.policy) == policy and isinstance(r.loss_scale(), scale) and r.master == master


def test_same_names_as_the_torch_side():
    for name in ("fp32", "bf16-mixed", "fp16-mixed", "bf16-true", "fp16-true"):
        torch_side, jax_side = mixprec.get_recipe(name), mpj.get_recipe(name)
        assert (jax_side.name, jax_side.loss_scaling) == (torch_side.name, torch_side.loss_scaling)
        assert mpj.policy.policy_label(jax_side.policy) == str(torch_side.policy)
    assert mpj.get_recipe("bf16-mixed").fp32_norms and not mpj.get_recipe("fp32").fp32_norms


def test_dynamic_scale_starts_at_torch_gradscalers_defaults_and_takes_overrides():
    ls = mpj.get_recipe("fp16-mixed").loss_scale()
    assert (float(ls.loss_scale), ls.period, ls.factor) == (2.0**16, 2000, 2)
    tuned = mpj.get_recipe("fp16-mixed").loss_scale(2.0**10, hysteresis=2, max_loss_scale=2.0**20, min_loss_scale=2.0**-4)
    assert (float(tuned.loss_scale), tuned.hysteresis, float(tuned.max_loss_scale), float(tuned.min_loss_scale)) == \
           (2.0**10, 2, 2.0**20, 2.0**-4)
    with pytest.raises(ValueError, match="tune a dynamic one"):
        mpj.get_recipe("bf16-mixed").loss_scale(hysteresis=2)


def test_prepare_params_keeps_an_fp32_master():
    params = {"w": jnp.ones(2, jnp.bfloat16), "step": jnp.int32(0)}
    out = mpj.get_recipe("bf16-true").prepare_params(params)
    assert out["w"].dtype == jnp.float32 and out["step"].dtype == jnp.int32


@pytest.mark.parametrize("name, match", [
    ("bf16-true-kahan", "only the torch side implements"),
    ("fp16-pure", "only the torch side implements"),
    ("fp17-mixed", "Unknown recipe 'fp17-mixed'"),
])
def test_unsupported_and_unknown_recipes_are_refused_with_the_list(name, match):
    with pytest.raises(ValueError, match=match) as info:
        mpj.get_recipe(name)
    assert "mixprec.jax runs" in str(info.value) and "bf16-mixed" in str(info.value)


def test_auto_gives_a_reason():
    r = mpj.get_recipe("auto")
    assert r.reason.startswith("auto:") and r.name in ("fp32", "bf16-mixed", "fp16-mixed")
