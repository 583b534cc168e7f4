"""save_tree / load_tree: leaves round-trip bit for bit (bf16 included), and a checkpoint from another
configuration is refused, naming the difference."""

import numpy as np
import pytest

pytest.importorskip("jax.numpy")  # a submodule, not "jax": see conftest
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import mixprec.jax as mpj  # noqa: E402


def _tree(min_scale=2.0**-10, hysteresis=2):
    return {
        "params": {"w": jnp.asarray(np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)), "h": jnp.ones(3, jnp.bfloat16)},
        "scale": mpj.DynamicLossScale(jnp.float32(2.0**12), jnp.int32(5), min_loss_scale=jnp.float32(min_scale),
                                      hysteresis=hysteresis, max_loss_scale=2.0**20),
        "count": jnp.int32(17),
        "weak": jnp.asarray(0.5),  # a weakly typed scalar: it must come back weak, or promotion changes
        "np": np.arange(3),
    }


def test_round_trip_is_bitwise_and_keeps_types(tmp_path):
    tree = _tree()
    tree["params"]["h"] = jnp.asarray([1.5, -0.0, 3.0], jnp.bfloat16)
    mpj.save_tree(tmp_path / "t.npz", tree)
    back = mpj.load_tree(tmp_path / "t.npz", _tree())
    assert [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(back)] == \
           [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(tree)]
    assert back["params"]["h"].dtype == jnp.bfloat16 and back["weak"].weak_type and isinstance(back["np"], np.ndarray)
    assert float(back["scale"].min_loss_scale) == 2.0**-10 and int(back["scale"].hysteresis_left) == 2


def test_another_loss_scale_configuration_is_refused(tmp_path):
    mpj.save_tree(tmp_path / "t.npz", _tree())
    with pytest.raises(ValueError, match="different tree or configuration"):
        mpj.load_tree(tmp_path / "t.npz", _tree(min_scale=1.0))
    with pytest.raises(ValueError, match="holds 8 leaves, `like` has 7"):
        mpj.load_tree(tmp_path / "t.npz", _tree(hysteresis=1), strict=False)


def test_mismatched_leaf_is_named(tmp_path):
    mpj.save_tree(tmp_path / "t.npz", _tree())
    like = _tree()
    like["params"]["w"] = jnp.zeros((3, 2))
    with pytest.raises(ValueError, match=r"\['params'\]\['w'\] is float32\[2, 3\]"):
        mpj.load_tree(tmp_path / "t.npz", like, strict=False)


def test_not_a_checkpoint(tmp_path):
    np.savez(tmp_path / "other.npz", a=np.ones(2))
    with pytest.raises(ValueError, match="not a mixprec.jax checkpoint"):
        mpj.load_tree(tmp_path / "other.npz", {"a": np.ones(2)})
