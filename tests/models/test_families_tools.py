"""The tools on the real model families (slow): ``doctor`` raises no false alarm on a healthy run
(fp16-mixed's first overflows are the scaler's warm-up, fp8-delayed is probed after its warm-up)
and still alarms where fp8-unscaled flushes gradients; ``torch.compile`` of a 16-bit storage model
(dynamo, the eager backend) matches eager (Llama, T5), inside and outside mp.autocast()."""

from __future__ import annotations

import warnings

import pytest
import torch

from hf_tasks import make  # (skips without transformers)
from hf_zoo import FAMILIES, batch, build
from mixprec import MixedPrecision
from mixprec.diagnostics.doctor import doctor

pytestmark = pytest.mark.slow


def _alarms(report):
    return [(f.check, f.summary) for f in report.findings if f.alarming]


@pytest.mark.parametrize("family", FAMILIES)
def test_doctor_finds_nothing_alarming_in_a_healthy_fp16_run(family):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = doctor(make(family), "fp16-mixed", "cpu", steps=3)
    assert _alarms(report) == []
    step = report.get("recipe-step")
    if report.evidence.run.skipped[0]:  # the scaler's first overflows (ResNet's): its warm-up, said so
        assert step.status == "ok" and "warm-up" in step.summary


@pytest.mark.parametrize("family", ["llama", "bert", "vit"])
def test_doctor_probes_fp8_delayed_after_its_warm_up(family):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = doctor(make(family), "fp8-delayed", "cpu", steps=3)
    assert _alarms(report) == [] and report.evidence.fp8_step == 3


def test_doctor_alarms_where_fp8_unscaled_flushes_gradients():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = doctor(make("llama"), "fp8-unscaled", "cpu", steps=2)
    fp8 = report.get("fp8-casts")
    assert fp8.status == "alarm" and "grad_output" in fp8.summary


# (~10-30 s of dynamo tracing each; GPT-2's labels= path is compiled with inductor in
# test_compile_graph_breaks.py)
@pytest.mark.parametrize("family", ["llama", "t5"])
def test_compiled_storage_model_matches_eager(family):
    torch._dynamo.reset()
    mps, models = [], []
    for _ in range(2):
        mp = MixedPrecision("bf16-true", "cpu")
        mps.append(mp)
        models.append(mp.prepare(build(family)).eval())
    compiled = torch.compile(models[0], backend="eager")  # HF's forwards break the graph in places
    kw = batch(family, 5)
    with torch.no_grad():
        with mps[0].autocast():
            inside = compiled(**kw).logits
        outside = compiled(**kw).logits
        want = models[1](**kw).logits
    assert torch.equal(inside, want) and torch.equal(outside, want)
