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


def test_a_save_interrupted_midway_leaves_the_previous_checkpoint_whole(tmp_path, monkeypatch):
    # found by qa: save_tree wrote into the file in place: a Ctrl-C (or a kill) during the write destroyed the
    # checkpoint it was replacing
    path = tmp_path / "t.npz"
    mpj.save_tree(path, _tree())
    real = np.savez

    def interrupted(f, **arrays):
        real(f, **arrays)
        f.truncate(f.tell() // 2)  # half of it on disk, then the interrupt
        raise KeyboardInterrupt

    monkeypatch.setattr(np, "savez", interrupted)
    newer = _tree()
    newer["count"] = jnp.int32(18)
    with pytest.raises(KeyboardInterrupt):
        mpj.save_tree(path, newer)
    monkeypatch.undo()
    assert int(mpj.load_tree(path, _tree())["count"]) == 17  # the previous one, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.npz"]  # and nothing half-written beside it


@pytest.mark.parametrize("damage", ["junk", "truncated", "empty"])
def test_a_damaged_file_is_said_to_be_damaged_without_advice_to_unpickle_it(tmp_path, damage):
    # found by qa: junk gave numpy's "contains pickled (object) data. If you trust the file you can load it unsafely
    # using allow_pickle=", a truncated file zipfile's bare BadZipFile
    path = tmp_path / "t.npz"
    mpj.save_tree(path, _tree())
    raw = path.read_bytes()
    path.write_bytes({"junk": b"junk" * 10, "truncated": raw[: len(raw) // 2], "empty": b""}[damage])
    with pytest.raises(ValueError) as e:
        mpj.load_tree(path, _tree())
    assert "cannot be read as a mixprec.jax checkpoint" in str(e.value) and "pickle" not in str(e.value), str(e.value)


def test_a_leaf_that_is_not_an_array_is_named(tmp_path):
    with pytest.raises(TypeError, match=r"leaf \['fn'\] is a function, not an array"):
        mpj.save_tree(tmp_path / "t.npz", {"w": jnp.ones(2), "fn": lambda: 1})
    assert not (tmp_path / "t.npz").exists()
