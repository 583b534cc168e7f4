"""Probes of low-precision inference: a verdict is computed with the 16-bit rounding it claims,
whatever the forward calls (a submodule, a functional op), and --weights says what it loaded."""

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from inference import zoo
from mixprec.cli import main
from mixprec.inference import cast_for_inference, check_inference

ZOO = zoo.__name__


class Wrapped(nn.Module):
    """A model whose work is all in a submodule: ``model.body(x)`` is what ``model(x)`` computes."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


@pytest.mark.parametrize("mode", ["storage", "autocast"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_a_submodule_called_on_its_own_computes_what_it_computes_in_the_model(mode, dtype):
    torch.manual_seed(0)
    model = Wrapped()
    lp = cast_for_inference(model, dtype, mode=mode)
    x = torch.randn(8, 16)
    with torch.no_grad():
        whole, part = lp(x), lp.body(x)
    assert part.dtype == whole.dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    assert torch.equal(part, whole)  # the same ops in the same dtype, not fp32 (autocast) or a dtype error (storage)
    with torch.no_grad():
        assert not torch.equal(part.float(), model(x))  # rounded: 16-bit inference, not the fp32 model again


@pytest.mark.parametrize("mode", ["storage", "autocast"])
def test_a_forward_through_a_submodule_gets_the_verdict_of_the_whole_model(mode):
    torch.manual_seed(0)
    model = Wrapped()
    batches = [torch.randn(8, 16) for _ in range(2)]
    direct = check_inference(model, batches, "both", mode=mode)
    via = check_inference(model, batches, "both", mode=mode, forward=lambda m, x: m.body(x))
    for name in ("bf16", "fp16"):
        a, b = direct.results[name], via.results[name]
        assert b.error is None and b.verdict == a.verdict == "agree"
        # bit for bit the same computation: the same noise, and noise there is (an fp32 run would have none)
        assert b.outputs[0].noise == a.outputs[0].noise > 0 and math.isfinite(b.outputs[0].sqnr)


@pytest.mark.parametrize("mode", ["storage", "autocast"])
def test_a_functional_forward_runs_in_16_bits(mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 10))
    batches = [torch.randn(8, 16)]
    direct = check_inference(model, batches, "bf16", mode=mode)
    via = check_inference(model, batches, "bf16", mode=mode, forward=lambda m, x: F.linear(x, m[0].weight, m[0].bias))
    res = via.results["bf16"]
    assert res.error is None and res.verdict == "agree"
    assert res.outputs[0].noise == direct.results["bf16"].outputs[0].noise > 0


def _tiny_lm_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return zoo.TinyLM().state_dict()


def test_weights_in_16_bits_are_said_to_be_what_the_fp32_reference_is(tmp_path, capsys):
    state = {k: v.to(torch.bfloat16) if k.endswith("qkv.weight") else v for k, v in _tiny_lm_state().items()}
    path = tmp_path / "w16.pt"
    torch.save(state, path)
    assert main(["infer-check", "--task", f"{ZOO}:make_tiny_lm", "--weights", str(path), "--batches", "1",
                 "--json"]) == 0
    err = capsys.readouterr().err
    assert "2 in bfloat16 (layers.0.qkv.weight, layers.1.qkv.weight)" in err
    assert "mp.fp32_state_dict(model)" in err


def test_fp32_weights_load_without_a_note(tmp_path, capsys):
    path = tmp_path / "w.pt"
    torch.save(_tiny_lm_state(), path)
    assert main(["infer-check", "--task", f"{ZOO}:make_tiny_lm", "--weights", str(path), "--batches", "1",
                 "--json"]) == 0
    assert "note:" not in capsys.readouterr().err


def test_weights_that_hold_a_tied_weight_once_load(tmp_path, capsys):
    state = _tiny_lm_state()
    del state["lm_head.weight"]  # tied to embed.weight: a safetensors export holds it once
    state["embed.weight"] = state["embed.weight"] * 2  # (so that a load that skipped it would show)
    path = tmp_path / "w.pt"
    torch.save(state, path)
    assert main(["infer-check", "--task", f"{ZOO}:make_tiny_lm", "--weights", str(path), "--batches", "1",
                 "--json"]) == 0
    from mixprec.inference import cli

    model = zoo.TinyLM()
    cli._load_weights(model, str(path))
    assert torch.equal(model.lm_head.weight, state["embed.weight"]) and model.lm_head.weight is model.embed.weight


class NormsOnly(nn.Module):
    """Embedding then LayerNorm: the inference rules keep both in fp32, so no 16-bit op runs."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.norm = nn.Embedding(50, 16), nn.LayerNorm(16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.norm(self.emb(ids))


@pytest.mark.parametrize("mode", ["storage", "autocast"])
def test_an_agree_with_no_16bit_rounding_says_it_judged_nothing(mode):
    torch.manual_seed(0)
    ids = [torch.randint(0, 50, (4, 8)) for _ in range(2)]
    untouched = check_inference(NormsOnly(), ids, "bf16", mode=mode).results["bf16"]
    assert untouched.verdict == "agree" and untouched.same_as_fp32 and untouched.to_dict()["same_as_fp32"]
    assert any("bit for bit: no bf16 rounding reached them" in line for line in untouched.lines())
    torch.manual_seed(0)
    rounded = check_inference(Wrapped(), [torch.randn(8, 16)], "bf16", mode=mode).results["bf16"]
    assert not rounded.same_as_fp32 and not any("bit for bit" in line for line in rounded.lines())
