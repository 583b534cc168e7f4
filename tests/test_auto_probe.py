"""Nothing silent in ``auto``, fp32 attention and islands: a malformed cache entry is measured
again (never a crash, never a decision from a number that is not one), a cache that could not be
written is not called a cache in the reason, attention="fp32" on a model without an SDPA call says
so, and an island rule (class, predicate) that matches nothing is said."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec import autotune, recipes
from mixprec.islands import keep_fp32

COMPUTE = "compute: bf16 autocast vs fp32, linear 512x256->1024 fwd+bwd"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(autotune.ENV_DIR, str(tmp_path))
    monkeypatch.delenv(autotune.ENV_MODE, raising=False)
    monkeypatch.setattr(autotune, "_MEMO", {})
    monkeypatch.setattr(autotune, "_WARNED", set())
    monkeypatch.setattr(autotune, "_load", lambda: 0.5)
    calls = {"compute": 0}

    def compute(device):
        calls["compute"] += 1
        return {"bf16_s": 1.0, "fp32_s": 2.0}

    monkeypatch.setattr(autotune, "MEASURE", {"compute": compute, "attention": lambda sig, d: {"low_s": 1.0, "fp32_s": 2.0}})
    return tmp_path / "autotune.json", calls


@pytest.mark.parametrize("entry", [
    {"result": {"fp32_s": 1.0, "bf16_s": 0.0}},  # a division by zero
    {"result": {"fp32_s": "1", "bf16_s": 1.0}},
    {"result": {"fp32_s": 1.0}},
    {"result": None},
    {"result": [1, 2]},
    {"result": {"fp32_s": float("nan"), "bf16_s": 1.0}},  # NaN >= 1.05 is False: a silent fp32
    {"result": {"fp32_s": -3.0, "bf16_s": 1.0}},
    "not an entry",
], ids=["zero", "str", "missing", "none", "list", "nan", "negative", "string"])
def test_a_malformed_cache_entry_is_measured_again_with_a_warning(cache, entry):
    path, calls = cache
    key = f"{autotune.machine_key(torch.device('cpu'))} || {COMPUTE}"
    path.write_text(json.dumps({"schema": autotune.SCHEMA, "entries": {key: entry, "other": "junk"}}))
    with pytest.warns(RuntimeWarning, match="malformed entry of the autotune cache"):
        r = mixprec.resolve_recipe("auto", "cpu")
    assert calls["compute"] == 1 and r.name == "bf16-mixed"  # what the fresh measurement (2x) says
    assert "measured 2.00x" in r.reason
    entries = json.loads(path.read_text())["entries"]
    assert entries[key]["result"] == {"bf16_s": 1.0, "fp32_s": 2.0} and "other" not in entries
    autotune._MEMO.clear()  # a new process: the replaced entry is used
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "measured earlier 2.00x" in mixprec.resolve_recipe("auto", "cpu").reason
    assert calls["compute"] == 1


def test_a_cache_that_cannot_be_written_is_not_called_a_cache_in_the_reason(cache, monkeypatch):
    path, _ = cache

    def refuse(p, entries):
        raise PermissionError(13, "Permission denied", str(p))

    monkeypatch.setattr(autotune, "_write", refuse)
    with pytest.warns(RuntimeWarning, match="cannot write the autotune cache"):
        r = mixprec.resolve_recipe("auto", "cpu")
    assert "not cached: cannot write" in r.reason and f"cache: {path}" not in r.reason
    assert not path.exists()


def test_bf16_that_cannot_run_is_measured_as_fp32_and_said(cache, monkeypatch):
    path, _ = cache
    real = autotune._timeit

    def timeit(arms, device, **kw):
        if "bf16" in arms:
            raise RuntimeError("no bf16 kernel for this CPU")
        return real(arms, device, rounds=3, budget_s=0.01)

    monkeypatch.setattr(autotune, "_timeit", timeit)
    monkeypatch.setattr(autotune, "MEASURE", {"compute": autotune.measure_compute})
    r = mixprec.resolve_recipe("auto", "cpu")  # no crash: a training script starts
    assert r.name == "fp32" and "bf16 autocast could not run here" in r.reason and "no bf16 kernel" in r.reason


def test_the_cache_path_is_absolute_and_a_relative_xdg_cache_home_is_ignored(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(autotune.ENV_DIR, "rel")
    assert autotune.cache_path() == tmp_path / "rel" / "autotune.json"
    monkeypatch.delenv(autotune.ENV_DIR)
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert autotune.cache_path() == tmp_path / "home" / ".cache" / "mixprec" / "autotune.json"


# ---------------------------------------------------------------- fp32 attention


class Attn(nn.Module):
    def __init__(self, sdpa: bool, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.sdpa, self.heads, self.qkv = sdpa, heads, nn.Linear(d, 3 * d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        if self.sdpa:
            o = F.scaled_dot_product_attention(q, k, v)
        else:  # eager attention: no product for mixprec.attention to route
            o = torch.softmax(q @ k.transpose(-1, -2) / (C // self.heads) ** 0.5, -1) @ v
        return o.transpose(1, 2).reshape(B, T, C)


def test_fp32_attention_on_a_model_without_sdpa_says_so():
    mp = mixprec.MixedPrecision("bf16-mixed", "cpu", attention="fp32")
    model = mp.prepare(Attn(sdpa=False))
    with pytest.warns(UserWarning, match="called no F.scaled_dot_product_attention"):
        with mp.autocast():
            model(torch.randn(2, 4, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        with mp.autocast():
            model(torch.randn(2, 4, 16))
    assert "attention ran as the recipe computes it" in mp.describe() and "2 16-bit forward(s)" in mp.describe()
    model(torch.randn(2, 4, 16))  # outside autocast: an fp32 forward is no miss
    assert "2 16-bit forward(s)" in mp.describe()


def test_fp32_attention_with_sdpa_does_not_warn():
    mp = mixprec.MixedPrecision("bf16-mixed", "cpu", attention="fp32")
    model = mp.prepare(Attn(sdpa=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with mp.autocast():
            model(torch.randn(2, 4, 16))
    assert mp.attention.calls["fp32"] == 1 and "fp32 (F.scaled_dot_product_attention" in mp.describe()


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_fp32_attention_on_a_tiny_hf_gpt2(impl, monkeypatch):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=64, n_positions=16,
                                  bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = impl
    torch.manual_seed(0)
    mp = mixprec.MixedPrecision("bf16-mixed", "cpu", attention="fp32")
    model = mp.prepare(transformers.GPT2LMHeadModel(cfg).eval())
    seen = []
    attend = type(mp.attention).attend

    def spy(**kw):  # the fp32 path calls the product with keywords only
        out = F.scaled_dot_product_attention(**kw)
        seen.append(([kw[n].dtype for n in ("query", "key", "value")], torch.is_autocast_enabled("cpu"), out, kw))
        return out

    monkeypatch.setattr(type(mp.attention), "attend", lambda self, func, a, k: attend(self, spy, a, k))
    ids = torch.randint(0, 64, (2, 8))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with mp.autocast():
            model(input_ids=ids)
    missed = [x for x in w if "called no F.scaled_dot_product_attention" in str(x.message)]
    if impl == "eager":
        assert not seen and len(missed) == 1
        return
    assert len(seen) == cfg.n_layer and not missed
    for dtypes, autocast_on, out, kw in seen:
        assert dtypes == [torch.float32] * 3 and not autocast_on and out.dtype == torch.float32
        with torch.autocast("cpu", enabled=False):  # the same product, by hand, in fp32: exactly it
            ref = F.scaled_dot_product_attention(**kw)
        assert torch.equal(out, ref)


# ---------------------------------------------------------------- islands


def test_an_island_rule_class_or_predicate_that_matches_nothing_is_said():
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with pytest.warns(UserWarning, match=r"class torch\.nn\.modules\.conv\.Conv2d\) matches no submodule"):
        assert keep_fp32(net, [nn.Conv2d]) == []
    with pytest.warns(UserWarning, match=r"predicate .* matches no submodule"):
        assert keep_fp32(net, [lambda name, m: name == "head"]) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert keep_fp32(net, [nn.Linear, lambda name, m: name == "1"]) == ["0", "1"]


def test_recipes_json_says_autos_attention(capsys, cache, monkeypatch):
    from mixprec.cli import main

    monkeypatch.setattr(recipes, "cpu_bf16_support", lambda: (True, "this CPU has AMX"))
    assert main(["recipes", "--json", "--device", "cpu"]) == 0
    auto = json.loads(capsys.readouterr().out)["auto"]
    assert auto["recipe"] == "bf16-mixed" and auto["attention"] == "fastest"
