"""check_inference on models that agree, degrade and break, and where it says they break."""

import pytest
import torch

from inference import zoo
from mixprec.inference import InferenceCheckError, check_inference
from mixprec.tasks.charlm import CharGPT


def _batches(shape, n=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) for _ in range(n)]


def test_a_local_llm_stand_in_agrees_in_fp16_and_bf16():
    torch.manual_seed(0)
    model = zoo.TinyLM()
    report = check_inference(model, zoo.lm_batches(2), "both")
    assert report.verdict == "agree" and report.exit_code == 0
    for name, floor in (("bf16", 40.0), ("fp16", 58.0)):  # measured 50.5 / 68.6 dB
        (logits,) = report.results[name].outputs
        assert logits.name == "logits" and logits.classes
        assert logits.sqnr > floor and logits.top1_ties_aside >= 0.99 and logits.topk_mean > 0.9


def test_the_fp32_model_is_left_as_it_was():
    torch.manual_seed(0)
    model = CharGPT(d_model=16, n_layer=1, n_head=2, seq_len=8).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    hooks = sum(len(m._forward_hooks) for m in model.modules())
    check_inference(model, [torch.randint(0, 96, (2, 8))], "fp16")
    assert model.training and sum(len(m._forward_hooks) for m in model.modules()) == hooks
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_fp16_overflow_is_broken_at_the_module_that_overflowed_and_bf16_agrees():
    torch.manual_seed(0)
    report = check_inference(zoo.Overflow(), _batches((32, 8)), "both")
    assert report.verdict == "broken" and report.exit_code == 1
    assert report.results["bf16"].verdict == "agree"
    fp16 = report.results["fp16"]
    assert fp16.verdict == "broken" and "non-finite" in fp16.reasons[0]
    f = fp16.failure
    assert (f.module, f.module_type, f.cause, f.batch) == ("amp", "Linear", "overflow", 0)
    assert f.fp32_absmax > 65504 and "past fp16's max 65504" in f.describe()
    assert [n.module for n in fp16.near_overflow] == ["amp"]


def test_an_overflow_inside_a_modules_forward_names_that_module():
    torch.manual_seed(0)
    report = check_inference(zoo.LogitOverflow(), _batches((4, 6, 16)), "fp16")
    f = report.results["fp16"].failure
    assert (f.module, f.cause) == ("attn", "inside")  # q @ k.T is no module: its block is named
    assert f.fp32_absmax < 65504 and "probe_activation_range" in f.describe()


def test_cancellation_in_the_forward_degrades_bf16_not_fp16_and_is_placed_before_the_head():
    torch.manual_seed(0)
    report = check_inference(zoo.Cancel(), _batches((64, 16)), "both")
    bf16, fp16 = report.results["bf16"], report.results["fp16"]
    assert fp16.verdict == "agree"
    assert bf16.verdict == "degraded" and bf16.reasons[0].startswith("output: SQNR")
    d = bf16.degradation
    assert d.module == "head" and d.input_sqnr_db < 30 and "the model's own forward" in d.describe()
    assert fp16.degradation is None


def test_a_low_precision_forward_that_raises_is_broken():
    class Strict(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            if self.lin.weight.dtype != torch.float32:
                raise RuntimeError("expected fp32 weights")
            return self.lin(x)

    report = check_inference(Strict(), _batches((2, 4)), "bf16")
    r = report.results["bf16"]
    assert r.verdict == "broken" and "expected fp32 weights" in r.error and r.outputs == []


def test_dict_inputs_targets_and_the_loss():
    torch.manual_seed(0)
    model = zoo.TinyLM()
    batches = [({"input_ids": b["input_ids"]}, b["input_ids"]) for b in zoo.lm_batches(2)]
    loss = zoo.make_tiny_lm().loss_fn
    report = check_inference(model, batches, "bf16", loss_fn=loss)
    fp32, bf16 = report.results["bf16"].loss
    assert bf16 == pytest.approx(fp32, rel=1e-2) and fp32 > 0


def test_what_cannot_be_checked_says_why():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(InferenceCheckError, match="no batches"):
        check_inference(model, [], "bf16")
    with pytest.raises(InferenceCheckError, match="fp32 model's forward raised RuntimeError on batch 0"):
        check_inference(model, [torch.randn(2, 5)], "bf16")
    with pytest.raises(InferenceCheckError, match="no floating-point tensor"):
        check_inference(model, [torch.randn(2, 4)], "bf16", forward=lambda m, x: m(x).argmax(-1))
    with pytest.raises(InferenceCheckError, match="no finite value"):
        check_inference(model, [torch.full((2, 4), float("nan"))], "bf16")
    with pytest.raises(InferenceCheckError, match="inputs, targets"):
        check_inference(model, [torch.randn(2, 4)], "bf16", loss_fn=lambda o, y: o.sum())
    with pytest.raises(InferenceCheckError, match="its outputs"):
        check_inference(model, [torch.randn(2, 4)], "bf16", classes=["logits"])
    with pytest.raises(ValueError, match="bf16 or fp16"):
        check_inference(model, [torch.randn(2, 4)], "fp8")


def test_the_report_round_trips_to_json_and_text():
    import json

    torch.manual_seed(0)
    task = zoo.make_overflow()
    report = check_inference(task.build_model(), [task.get_batch(0)], "fp16", loss_fn=task.loss_fn)
    data = json.loads(report.to_json())
    assert data["verdict"] == "broken" and data["results"]["fp16"]["failure"]["module"] == "amp"
    out = data["results"]["fp16"]["outputs"][0]
    assert out["sqnr_db"] == "nan" and out["nonfinite"] == 32 * 4  # nothing finite to compare: a string, not NaN
    assert data["results"]["fp16"]["loss"]["fp16"] == "nan"
    assert "'amp' (Linear)" in report.summary()


@pytest.mark.cuda
def test_on_cuda_both_dtypes_agree_and_the_overflow_is_found():
    torch.manual_seed(0)
    lm = zoo.TinyLM().cuda()
    report = check_inference(lm, zoo.lm_batches(2), "both")  # batches are moved to the model's device
    assert report.verdict == "agree", report.summary()
    report = check_inference(zoo.Overflow().cuda(), _batches((32, 8)), "fp16")
    assert report.results["fp16"].failure.module == "amp"
