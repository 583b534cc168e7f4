"""Two host devices (a subprocess: XLA_FLAGS must be set before jax starts): the skip decision is shared
under pmap and shard_map with axis_name, and is already global under jit over sharded arrays."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax.numpy")  # a submodule, not "jax": see conftest
pytest.importorskip("optax")


@pytest.fixture(scope="module")
def observed():
    from mixprec_test_env import src_env

    env = src_env()
    env["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("multidevice_run.py"))],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_two_devices(observed):
    assert observed["devices"] == 2


@pytest.mark.parametrize("kind", ["pmap_shared", "shard_map_shared"])
def test_one_overflowing_replica_makes_every_replica_skip_with_axis_name(observed, kind):
    o = observed[kind]
    assert o["skipped"] == [True, True] and o["scale"] == [512.0, 512.0]
    unchanged = o["params_unchanged"]  # per device under pmap; the one sharded array under shard_map
    assert all(unchanged) if isinstance(unchanged, list) else unchanged


@pytest.mark.parametrize("kind", ["pmap_local", "shard_map_local"])
def test_without_axis_name_local_decisions_split_the_replicas(observed, kind):
    """The failure axis_name prevents: replicas disagree, their scales and parameters drift apart."""
    o = observed[kind]
    assert o["skipped"] == [False, True] and o["scale"] == [1024.0, 512.0]


def test_gradients_already_all_reduced_carry_the_overflow_to_every_replica(observed):
    o = observed["pmap_pmean"]
    assert o["skipped"] == [True, True] and o["params_equal_across_devices"]


def test_jit_over_sharded_arrays_decides_globally(observed):
    o = observed["gspmd"]
    assert o["skipped"] and o["scale"] == 512.0 and o["params_unchanged"]


def test_the_docs_pattern_all_reduces_the_16_bit_scaled_gradient(observed):
    """The silent failure: fp32 replicated params cast inside a shard_map step: the implicit psum runs in
    fp16, and two finite per-device gradients of 40000 sum to inf (a forced skip). Under jit over
    NamedSharding inputs the partitioner does the same."""
    assert observed["reduce_compute_dtype"]["all_reduce"] == ["f16"]
    assert not observed["reduce_compute_dtype"]["finite"]
    assert observed["jit_named_sharding"]["all_reduce"] == ["f16"]


def test_cast_to_compute_varying_reduces_in_fp32(observed):
    o = observed["reduce_fp32"]
    assert o["all_reduce"] == ["f32"] and o["finite"] and o["grad"] == 80000.0


def test_audit_reads_the_compiled_all_reduce(observed):
    """The all-reduce jit inserts over sharded inputs exists only in the compiled HLO: audit finds it there."""
    o = observed["audit_jit"]
    assert o["kinds"] == ["16-bit-collective"] and [c[:2] for c in o["collectives"]] == [["f16", "all-reduce"]]
    assert "multidevice_run.py" in o["where"][0]
    clean = observed["audit_fp32_reduce"]
    assert clean["kinds"] == [] and [c[:2] for c in clean["collectives"]] == [["f32", "all-reduce"]]


def test_a_sharded_checkpoint_leaf_comes_back_sharded_as_like(observed):
    # found by a probe: load_tree put every restored leaf on device 0, whatever like's sharding
    assert observed["checkpoint_sharded"] == {"same_sharding": True, "equal": True, "devices": 2}
