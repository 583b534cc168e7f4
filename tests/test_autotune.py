"""``auto`` on a CPU decides by a cached measurement: the decision (both ways), the cache (keyed by
machine, atomic, a corrupt file ignored), and no measurement where the user named a recipe."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch

import mixprec
from mixprec import autotune, recipes
from mixprec_test_env import src_env


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh cache file and counting, injectable measurements."""
    monkeypatch.setenv(autotune.ENV_DIR, str(tmp_path))
    monkeypatch.delenv(autotune.ENV_MODE, raising=False)
    monkeypatch.setattr(autotune, "_MEMO", {})
    monkeypatch.setattr(autotune, "_WARNED", set())
    monkeypatch.setattr(autotune, "_load", lambda: 0.5)  # a quiet machine (test_a_busy_machine... is the other case)
    calls = {"compute": 0, "attention": 0}
    speeds = {"bf16_s": 1.0, "fp32_s": 2.0, "low_s": 2.0, "attn_fp32_s": 1.0}

    def compute(device):
        calls["compute"] += 1
        return {"bf16_s": speeds["bf16_s"], "fp32_s": speeds["fp32_s"]}

    def attention(sig, device):
        calls["attention"] += 1
        return {"low_s": speeds["low_s"], "fp32_s": speeds["attn_fp32_s"]}

    monkeypatch.setattr(autotune, "MEASURE", {"compute": compute, "attention": attention})
    return tmp_path / "autotune.json", calls, speeds


@pytest.mark.parametrize("bf16_s,expected", [(1.0, "bf16-mixed"), (3.0, "fp32")])
def test_auto_takes_what_was_measured_faster_whatever_the_flags_say(cache, monkeypatch, bf16_s, expected):
    path, calls, speeds = cache
    speeds["bf16_s"] = bf16_s
    monkeypatch.setattr(recipes, "cpu_bf16_support", lambda: (True, "this CPU has AMX"))  # flags say bf16
    r = mixprec.resolve_recipe("auto", "cpu")
    assert r.name == expected and calls["compute"] == 1
    assert r.reason.startswith("auto: this CPU has AMX; bf16 autocast measured") and f"{2.0 / bf16_s:.2f}x" in r.reason
    assert r.attention == ("fastest" if expected == "bf16-mixed" else "recipe")
    assert str(path) in r.reason and path.exists()


def test_the_measurement_is_cached_per_machine_and_measured_again_elsewhere(cache, monkeypatch):
    path, calls, _ = cache
    mixprec.resolve_recipe("auto", "cpu")
    monkeypatch.setattr(autotune, "_MEMO", {})  # a new process: only the file remembers
    r = mixprec.resolve_recipe("auto", "cpu")
    assert calls["compute"] == 1 and "measured earlier" in r.reason
    before = torch.get_num_threads()
    torch.set_num_threads(before + 1)  # another thread count is another machine
    try:
        mixprec.resolve_recipe("auto", "cpu")
    finally:
        torch.set_num_threads(before)
    monkeypatch.setattr(torch, "__version__", "9.9.9")  # so is another torch
    mixprec.resolve_recipe("auto", "cpu")
    assert calls["compute"] == 3
    entries = json.loads(path.read_text())["entries"]
    assert len(entries) == 3 and any(f"threads {before + 1}" in k for k in entries) and any("torch 9.9.9" in k for k in entries)


def test_a_measurement_on_a_busy_machine_is_used_but_not_cached(cache, monkeypatch):
    path, calls, _ = cache
    monkeypatch.setattr(autotune, "_load", lambda: 9.5)  # more runnable processes than CPUs
    r = mixprec.resolve_recipe("auto", "cpu")
    assert r.name == "bf16-mixed" and "measured on a busy machine (load 9.5" in r.reason and "not cached" in r.reason
    assert not path.exists()
    monkeypatch.setattr(autotune, "_MEMO", {})
    monkeypatch.setattr(autotune, "_load", lambda: 0.5)
    mixprec.resolve_recipe("auto", "cpu")  # measured again when the machine is quiet, and kept
    assert calls["compute"] == 2 and path.exists()


def test_refresh_measures_again_and_off_measures_nothing(cache, monkeypatch):
    _, calls, _ = cache
    mixprec.resolve_recipe("auto", "cpu")
    monkeypatch.setenv(autotune.ENV_MODE, "refresh")
    mixprec.resolve_recipe("auto", "cpu")
    assert calls["compute"] == 2
    monkeypatch.setenv(autotune.ENV_MODE, "off")
    monkeypatch.setattr(recipes, "cpu_bf16_support", lambda: (False, "this CPU has neither AVX512-BF16 nor AMX"))
    r = mixprec.resolve_recipe("auto", "cpu")
    assert calls["compute"] == 2 and r.name == "fp32" and "MIXPREC_AUTOTUNE=off, so chosen from the CPU's flags" in r.reason
    monkeypatch.setenv(autotune.ENV_MODE, "sometimes")
    with pytest.raises(ValueError, match="MIXPREC_AUTOTUNE='sometimes' is not one of on, off, refresh"):
        mixprec.resolve_recipe("auto", "cpu")


@pytest.mark.parametrize("content", [b"{not json", b"\x00\xff garbage", b'{"schema": 99, "entries": {}}', b"[1, 2]"])
def test_a_corrupt_cache_is_ignored_with_a_note_and_replaced(cache, content):
    path, calls, _ = cache
    path.write_bytes(content)
    with pytest.warns(RuntimeWarning, match="ignoring the autotune cache .* measuring again"):
        r = mixprec.resolve_recipe("auto", "cpu")
    assert r.name == "bf16-mixed" and calls["compute"] == 1
    assert json.loads(path.read_text())["schema"] == autotune.SCHEMA  # rewritten whole


def test_an_unwritable_cache_keeps_the_choice_for_the_process_and_says_so(cache, monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(autotune.ENV_DIR, str(blocker / "sub"))  # a directory under a file: cannot be made
    with pytest.warns(RuntimeWarning, match="cannot write the autotune cache"):
        r = mixprec.resolve_recipe("auto", "cpu")
    assert r.name == "bf16-mixed"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mixprec.resolve_recipe("auto", "cpu")  # remembered in the process, warned once
    assert cache[1]["compute"] == 1


def test_a_write_killed_midway_leaves_the_previous_cache_whole(cache, tmp_path):
    path, _, _ = cache
    mixprec.resolve_recipe("auto", "cpu")
    before = path.read_bytes()
    script = (
        "import os, time, torch\n"
        "from mixprec import autotune\n"
        "def slow_fsync(fd):\n"
        "    print('writing', flush=True); time.sleep(60)\n"
        "os.fsync = slow_fsync\n"
        "autotune.MEASURE['compute'] = lambda d: {'bf16_s': 9.0, 'fp32_s': 1.0}\n"
        "autotune._load = lambda: 0.5\n"  # (a busy machine would not write the cache at all)
        "os.environ['MIXPREC_AUTOTUNE'] = 'refresh'\n"
        "autotune.compute_choice(torch.device('cpu'))\n"
    )
    env = {**src_env(), autotune.ENV_DIR: str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"  # the new file is half written, not yet in place
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert path.read_bytes() == before  # the old cache, whole
    r = mixprec.resolve_recipe("auto", "cpu")
    assert r.name == "bf16-mixed"  # and it still reads


def test_no_measurement_runs_where_the_user_named_a_recipe(cache):
    _, calls, _ = cache
    for name in ("bf16-mixed", "fp32", "bf16-true", "fp16-mixed", "p=f32,c=bf16,o=f32"):
        mp = mixprec.MixedPrecision(name, "cpu")
        model = mp.prepare(_attention_model())
        with mp.autocast():
            model(torch.randn(2, 8, 16))
        assert mp.attention is None
    assert calls == {"compute": 0, "attention": 0}


def _attention_model():
    from mixprec.bench.block import RefBlock, Shape

    torch.manual_seed(0)
    return RefBlock(Shape("t", d_model=16, n_head=2, batch=2, seq=8))


@pytest.mark.parametrize("low_s,expected", [(2.0, "fp32"), (0.5, "recipe")])
def test_auto_runs_attention_in_fp32_exactly_where_that_was_measured_faster(cache, monkeypatch, low_s, expected):
    _, calls, speeds = cache
    speeds["low_s"] = low_s
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append((args[0] if args else kwargs["query"]).dtype)
        return sdpa(*args, **kwargs)

    mp = mixprec.MixedPrecision("auto", "cpu")
    model = mp.prepare(_attention_model())
    monkeypatch.setattr(type(mp.attention), "attend", lambda self, func, a, k, _orig=type(mp.attention).attend:
                        _orig(self, spy, a, k))
    for _ in range(2):
        with mp.autocast():
            out = model(torch.randn(2, 8, 16))
        mp.step(out.float().square().mean(), torch.optim.SGD(model.parameters(), lr=0.1))
    assert calls["attention"] == 1  # one shape: measured once
    assert seen == [torch.float32 if expected == "fp32" else torch.bfloat16] * 2
    assert f"fp32 for {1 if expected == 'fp32' else 0} of 1 shape(s)" in mp.describe()


def test_attention_shapes_are_measured_once_per_power_of_two_bucket(cache):
    _, calls, _ = cache
    from mixprec.attention import AttentionForward

    model = _attention_model()
    fwd = AttentionForward(model, "fastest", torch.device("cpu"))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for t in (100, 128, 65, 200):  # 100, 128 and 65 round up to 128; 200 to 256
        q = torch.randn(2, 2, t, 8, dtype=torch.bfloat16)
        fwd.attend(sdpa, (q, q, q), {})
    assert calls["attention"] == 2 and len(fwd.choices) == 2


def test_measurements_really_measure_and_fit_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(autotune.ENV_DIR, str(tmp_path))
    monkeypatch.setattr(autotune, "_MEMO", {})
    monkeypatch.setattr(autotune, "_load", lambda: 0.5)  # cached whatever the load of this machine
    t0 = time.perf_counter()
    res = autotune.measure_compute(torch.device("cpu"))
    sig = ("bfloat16", 1, 2, 2, 32, 32, 16, 16, True, "bool", False, False)
    att = autotune.measure_attention(sig, torch.device("cpu"))
    assert time.perf_counter() - t0 < 30
    assert res["fp32_s"] > 0 and res["bf16_s"] > 0 and att["fp32_s"] > 0 and att["low_s"] > 0
    assert autotune.attention_choice(sig, torch.device("cpu")) in ("fp32", "recipe")
    assert json.loads((tmp_path / "autotune.json").read_text())["schema"] == autotune.SCHEMA


@pytest.mark.parametrize("method", [None, autotune.METHOD - 1, "v9"], ids=["none", "older", "foreign"])
def test_an_entry_measured_by_another_method_is_measured_again_with_a_note(cache, method):
    path, calls, _ = cache
    key = f"{autotune.machine_key(torch.device('cpu'))} || compute: bf16 autocast vs fp32, linear 512x256->1024 fwd+bwd"
    entry = {"result": {"bf16_s": 9.0, "fp32_s": 1.0}, "measured": "2020-01-01T00:00:00"}  # said fp32
    if method is not None:
        entry["method"] = method
    path.write_text(json.dumps({"schema": autotune.SCHEMA, "entries": {key: entry}}))
    with pytest.warns(RuntimeWarning, match=f"measured by .*method {autotune.METHOD}, so it measures again"):
        r = mixprec.resolve_recipe("auto", "cpu")
    assert calls["compute"] == 1 and r.name == "bf16-mixed" and "measured 2.00x" in r.reason  # the fresh number
    saved = json.loads(path.read_text())["entries"][key]
    assert saved["method"] == autotune.METHOD and saved["result"] == {"bf16_s": 1.0, "fp32_s": 2.0}
    autotune._MEMO.clear()  # a new process: the replaced entry is this method's, and is used without a word
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "measured earlier 2.00x" in mixprec.resolve_recipe("auto", "cpu").reason
    assert calls["compute"] == 1
