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


def _train_state(tx_lr=0.1):
    train_state = pytest.importorskip("flax.training.train_state")
    import optax

    # a lambda and optax's closures: static fields whose reprs name an address
    return train_state.TrainState.create(apply_fn=lambda p, x: x @ p["w"], params={"w": jnp.zeros((3, 2))},
                                         tx=mpj.skip_nonfinite(optax.adamw(tx_lr), "fp16-mixed"))


def test_a_flax_train_state_resumes_into_a_freshly_built_one(tmp_path):
    # found by a probe: str(treedef) held `<function ... at 0x7f...>` for TrainState's apply_fn and tx, so a
    # rebuilt state (what a resumed run has) never matched; and TrainState.create's step=0 (a Python int,
    # int64 on the host) refused the int32 a jitted apply_gradients leaves
    state = _train_state()
    grads = {"w": jnp.full((3, 2), 0.25)}
    step = jax.jit(lambda s, g: s.apply_gradients(grads=g))
    for _ in range(3):
        state = step(state, grads)
    mpj.save_tree(tmp_path / "ts.npz", state)
    back = mpj.load_tree(tmp_path / "ts.npz", _train_state())
    assert int(back.step) == 3 and back.step.dtype == state.step.dtype
    a, b = step(state, grads), step(back, grads)
    assert [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(a)] == \
           [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(b)]
    # a Python number saved as such still comes back as one
    mpj.save_tree(tmp_path / "fresh.npz", _train_state())
    assert type(mpj.load_tree(tmp_path / "fresh.npz", _train_state()).step) is int


def test_a_python_number_does_not_take_another_kind(tmp_path):
    mpj.save_tree(tmp_path / "t.npz", {"n": jnp.float32(1.5)})
    with pytest.raises(ValueError, match=r"\['n'\] is float32\[\] but `like` has \['n'\] as int64"):
        mpj.load_tree(tmp_path / "t.npz", {"n": 0})


def test_prng_keys_round_trip(tmp_path):
    # found by a probe: np.asarray of a typed key raised JAX's TypeError (nnx Rngs and Dropout hold keys)
    keys = {"one": jax.random.key(3), "batch": jax.random.split(jax.random.key(4), 5), "w": jnp.ones(2)}
    mpj.save_tree(tmp_path / "k.npz", keys)
    like = {"one": jax.random.key(0), "batch": jax.random.split(jax.random.key(0), 5), "w": jnp.zeros(2)}
    back = mpj.load_tree(tmp_path / "k.npz", like)
    for name in ("one", "batch"):
        assert back[name].dtype == keys[name].dtype
        assert np.array_equal(jax.random.key_data(back[name]), jax.random.key_data(keys[name]))
    assert np.array_equal(jax.random.normal(back["one"], (4,)), jax.random.normal(keys["one"], (4,)))
    with pytest.raises(ValueError, match=r"\['batch'\] is key<fry>\[5\] but `like` has \['batch'\] as key<fry>\[4\]"):
        mpj.load_tree(tmp_path / "k.npz", {**like, "batch": jax.random.split(jax.random.key(0), 4)})
    with pytest.raises(ValueError, match=r"key<fry>\[\] but `like` has \['one'\] as key<rbg>"):
        mpj.load_tree(tmp_path / "k.npz", {**like, "one": jax.random.key(0, impl="rbg")}, strict=False)


def test_nnx_state_with_rngs_round_trips(tmp_path):
    nnx = pytest.importorskip("flax.nnx")
    model = nnx.Dropout(0.5, rngs=nnx.Rngs(7))
    model(jnp.ones(8))  # advances the stream: the count is state
    mpj.save_tree(tmp_path / "m.npz", nnx.state(model))
    fresh = nnx.Dropout(0.5, rngs=nnx.Rngs(0))
    nnx.update(fresh, mpj.load_tree(tmp_path / "m.npz", nnx.state(fresh)))
    assert np.array_equal(model(jnp.ones(64)), fresh(jnp.ones(64)))


@pytest.mark.parametrize("dtype", ["float8_e5m2", "float8_e4m3fn", "bfloat16", "int4", "float4_e2m1fn"])
def test_narrow_dtypes_round_trip(tmp_path, dtype):
    # found by a probe: float8_e5m2 (numpy kind 'f', isbuiltin 2) was written raw, and np.load could not read it back
    dt = getattr(jnp, dtype, None)
    if dt is None:
        pytest.skip(f"jax has no {dtype}")
    x = jnp.asarray([1.0, -2.0, 0.5, 0.0], dt) if "int" not in dtype else jnp.asarray([1, -2, 3, 0], dt)
    mpj.save_tree(tmp_path / "n.npz", {"x": x})
    back = mpj.load_tree(tmp_path / "n.npz", {"x": jnp.zeros(4, dt)})["x"]
    assert back.dtype == x.dtype and np.asarray(back).tobytes() == np.asarray(x).tobytes()

