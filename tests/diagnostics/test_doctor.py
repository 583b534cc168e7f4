"""doctor names the right module and cause for each planted fault, and finds nothing alarming in healthy models."""

import json

import pytest

import mixprec
from mixprec.cli import main
from mixprec.diagnostics.doctor import doctor
from mixprec.tasks import load_task

from . import zoo

ZOO = zoo.__name__  # importable as-is: "tests.diagnostics.zoo" or "diagnostics.zoo", per how pytest imported it


@pytest.fixture(scope="module")
def reports():
    """One doctor run per zoo model (fp16-mixed on the CPU: a few seconds each)."""
    return {name: doctor(getattr(zoo, name)(), device="cpu") for name in zoo.FAULTS}


@pytest.mark.parametrize("factory", list(zoo.FAULTS))
def test_doctor_names_the_faulty_module_and_the_cause(reports, factory):
    module, cause = zoo.FAULTS[factory]
    report = reports[factory]
    assert report.alarming and report.exit_code == 1
    named = {(f.module, f.cause) for f in report.findings if f.status == "alarm"}
    assert (module, cause) in named, f"{factory}: alarms were {named}"


def test_doctor_separates_precision_faults_from_a_fault_fp32_has_too(reports):
    assert reports["make_nan_in_fp32"].get("fp32").status == "alarm"
    assert reports["make_nan_in_fp32"].get("bf16").summary.startswith("no: fp32 has the fault too")
    for name in ("make_log_zero", "make_tiny_variance_norm", "make_attention_overflow"):
        r = reports[name]
        assert r.get("fp32").status == "info" and "precision" in r.get("fp32").summary
        assert r.get("bf16").summary.startswith("yes: under bf16-mixed the same step is clean")


def test_doctor_follows_the_checklist_per_fault(reports):
    assert reports["make_log_zero"].get("loss-fp32").module == "criterion"  # the loss ran in f16 inside the model
    assert reports["make_log_zero"].get("math-domain").cause == "log-of-zero"
    assert reports["make_tiny_variance_norm"].get("norm-variance").cause == "tiny-variance"
    assert reports["make_tiny_variance_norm"].get("math-domain").op == "div"
    act = reports["make_attention_overflow"].get("activation-range")
    assert (act.module, act.op, act.cause) == ("attn", "matmul", "activation-overflow")
    under = reports["make_deep_narrow"].get("grad-underflow")
    assert "2^28" in under.fix and "measured in the fp16-mixed step: 100.0%" in "\n".join(under.evidence)
    # a forward NaN makes every scaled step skip: the scale check calls that a consequence
    assert reports["make_log_zero"].get("loss-scale").status == "info"


def test_doctor_finds_nothing_alarming_in_a_healthy_mlp():
    report = doctor(zoo.make_healthy_mlp(), device="cpu")
    assert not report.alarming and report.exit_code == 0
    assert {f.status for f in report.findings} <= {"ok", "info"}


def test_doctor_finds_nothing_alarming_in_the_builtin_task():
    report = doctor(load_task(None, batch_size=4, seq_len=16), device="cpu", steps=2)
    bad = [(f.check, f.summary) for f in report.findings if f.status not in ("ok", "info")]
    assert bad == []
    assert report.get("norm-variance").summary.startswith("no: normalisations run in fp32")


def test_doctor_report_writes_html_with_figures_and_json(reports, tmp_path):
    report = reports["make_deep_narrow"]
    written = report.write(tmp_path)
    html = written["doctor.html"].read_text()
    assert html.count("data:image/png;base64,") >= 3
    assert "layers.0" in html and "Which gradients flush to zero" in html
    assert written["grad_histogram.png"].read_bytes().startswith(b"\x89PNG")
    data = json.loads(written["doctor.json"].read_text())
    assert data["alarming"] is True
    assert data["probes"]["grad_underflow"]["recommended_scale"] == 2.0**28
    text = report.render_text()
    assert "ALARM" in text and "layers.0" in text and "fix:" in text


def test_cli_doctor_exits_1_on_alarms_with_json_and_0_when_healthy(tmp_path, capsys):
    rc = main(["doctor", "--task", f"{ZOO}:make_nan_in_fp32", "--out", str(tmp_path / "r"), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 1 and out["alarming"]
    assert any(f["module"] == "features" and f["cause"] == "sqrt-of-negative" for f in out["findings"])
    assert (tmp_path / "r" / "doctor.html").exists()
    rc = main(["doctor", "--task", f"{ZOO}:make_healthy_mlp", "--out", "", "--steps", "2"])
    text = capsys.readouterr().out
    assert rc == 0 and "nothing alarming" in text


def test_cli_doctor_exits_2_with_a_message_for_a_bad_task_or_recipe(capsys):
    assert main(["doctor", "--task", "no_such_module_xyz:make", "--out", ""]) == 2
    assert "cannot import module 'no_such_module_xyz'" in capsys.readouterr().err
    assert main(["doctor", "--task", f"{ZOO}:make_healthy_mlp", "--recipe", "fp17", "--out", ""]) == 2
    assert "Unknown recipe 'fp17'" in capsys.readouterr().err
    assert main(["doctor", "--recipe", "p=[red]", "--out", ""]) == 2
    assert "Unknown dtype '[red]' in policy 'p=[red]'" in " ".join(capsys.readouterr().err.split())  # not markup


def test_cli_doctor_exits_2_before_running_for_an_out_it_cannot_use(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    for out in (tmp_path / "notes.txt", tmp_path / "notes.txt" / "r"):  # a file; a directory under a file
        assert main(["doctor", "--task", f"{ZOO}:make_healthy_mlp", "--out", str(out)]) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert "is a file" in err and "running" not in err and "Traceback" not in err  # no step ran
    (tmp_path / "doctor.html").write_text("my own page")
    assert main(["doctor", "--task", f"{ZOO}:make_healthy_mlp", "--out", str(tmp_path)]) == 2
    assert "not written by 'mixprec doctor'" in " ".join(capsys.readouterr().err.split())
    assert (tmp_path / "doctor.html").read_text() == "my own page"
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_doctor_rewrites_its_own_report_but_not_foreign_files(reports, tmp_path):
    report = reports["make_deep_narrow"]
    assert report.write(tmp_path / "r") == report.write(tmp_path / "r")  # its own files: replaced
    (tmp_path / "grad_histogram.png").write_bytes(b"my figure")
    with pytest.raises(FileExistsError, match="grad_histogram.png, not written by 'mixprec doctor'"):
        report.write(tmp_path)
    assert (tmp_path / "grad_histogram.png").read_bytes() == b"my figure"


def test_cli_doctor_exits_2_with_one_line_when_the_task_code_raises(tmp_path, monkeypatch, capsys):
    (tmp_path / "doctor_raising_task.py").write_text("def make():\n    raise KeyError('config missing')\n")
    (tmp_path / "doctor_broken_module.py").write_text("def make(:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["doctor", "--task", "doctor_raising_task:make", "--out", ""]) == 2  # was a traceback, exit 1
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith("error: task factory doctor_raising_task:make raised KeyError: 'config missing' (raised at")
    assert "doctor_raising_task.py:2inmake)" in "".join(err.split())  # rich may break a long path anywhere
    assert main(["doctor", "--task", "doctor_broken_module:make", "--out", ""]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: SyntaxError") and "Traceback" not in err


def test_a_task_of_the_wrong_type_points_at_doctors_help_not_compares(tmp_path, monkeypatch, capsys):
    """Found by a probe: mixprec.tasks' message said "see 'mixprec compare --help'" under doctor too."""
    (tmp_path / "doctor_wrong_type_task.py").write_text("def make(**kw):\n    return 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["doctor", "--task", "doctor_wrong_type_task:make", "--out", ""]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "returned int, expected mixprec.tasks.Task" in err and "see 'mixprec doctor --help'" in err
    assert "compare --help" not in err


def test_doctor_is_exported_and_the_cli_module_loads_without_torch():
    import subprocess
    import sys
    from pathlib import Path

    assert mixprec.doctor is doctor
    src = str(Path(mixprec.__file__).resolve().parents[1])
    code = "import sys, mixprec.diagnostics.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": src, "PATH": ""})
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("recipe, status", [("bf16-true", "info"), ("bf16-true-kahan", "info"),
                                            ("bf16-pure", "alarm"), ("fp32", "info")])
def test_update_vanishing_alarms_only_where_nothing_keeps_the_updates(recipe, status):
    # the fragile task's weight loses most of its updates in bf16: only a recipe without masters loses them
    report = doctor("fragile", recipe, "cpu", steps=1)
    finding = report.get("update-vanishing")
    assert finding.status == status, finding.summary
    if recipe == "bf16-true":
        assert "fp32 master weights" in finding.summary and not report.alarming


def _evidence(recipe: str, params, kept=frozenset()):
    from mixprec.diagnostics.checks import Evidence
    from mixprec.diagnostics.probes.updates import UpdateVanishingReport
    from mixprec.recipes import resolve_recipe

    return Evidence(resolve_recipe(recipe, "cpu"), None, None, updates=UpdateVanishingReport(params, ("bf16", "f16"), 0.1),
                    kept_fp32=frozenset(kept))


def test_update_vanishing_names_the_worst_parameter_and_says_when_decay_alone_is_lost():
    from mixprec.diagnostics.checks import check_update_vanishing
    from mixprec.diagnostics.probes.updates import ParamUpdate

    params = [ParamUpdate("wpe.weight", 100, 100, {"bf16": 0.516, "f16": 0.0}, 1e-4, decay_only=0.9),
              ParamUpdate("h.0.mlp.weight", 100, 100, {"bf16": 1.0, "f16": 0.2}, 1e-4),
              ParamUpdate("ln.weight", 10, 10, {"bf16": 1.0, "f16": 1.0}, 1e-5)]
    f = check_update_vanishing(_evidence("bf16-pure", params, kept={"ln.weight"}))
    assert f.status == "alarm" and "worst: h.0.mlp.weight, 100.0%" in f.summary and f.module == "h.0.mlp.weight"
    assert "2 parameter(s)" in f.summary  # ln.weight is stored fp32 by the rule: not counted
    assert any("weight decay alone" in line for line in f.evidence if line.startswith("wpe.weight"))
    ok = check_update_vanishing(_evidence("bf16-pure", params[2:], kept={"ln.weight"}))
    assert ok.status == "ok" and "stored in fp32 by its rule: ln.weight" in ok.summary


# ---------------------------------------------------------------- the state the recipe trains in (issue 29.5)


def _regression(name, build_model, loss_scale=1.0):
    import torch
    import torch.nn.functional as F

    from mixprec.tasks import Task

    def get_batch(step):
        g = torch.Generator().manual_seed(step)
        return torch.randn(32, 32, generator=g), torch.randn(32, 16, generator=g)

    return Task(name=name, build_model=build_model, get_batch=get_batch,
                loss_fn=lambda out, y: F.mse_loss(out, y) * loss_scale)


def _loud_mlp():
    # gradients of ~100: at the default initial scale 2^16 they overflow fp16, so the scaler skips its first
    # steps, halving the scale until it fits (the routine warm-up of every fp16 run with large gradients)
    from torch import nn

    return _regression("loud-mlp", lambda: nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16)), 256.0)


def _fp8_mlp():
    from torch import nn

    return _regression("fp8-mlp", lambda: nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                                                        nn.Linear(64, 16)))


def test_the_scalers_first_overflows_are_its_warm_up_not_a_nan_outside_the_model():
    # was: ALARM "NaN arrived ... by code outside the model, op foreach_norm, check the batch" (the
    # scale monitor's own norm of the overflowed gradients, seen by the guard) and ALARM "collapse"
    report = doctor(_loud_mlp(), "fp16-mixed", "cpu", steps=3)
    assert not report.alarming, [(f.check, f.summary) for f in report.findings if f.alarming]
    run = report.evidence.run
    assert run.skipped[0] and not run.skipped[-1] and run.settle_steps >= 1  # it ran on to its first clean step
    step = report.get("recipe-step")
    assert step.status == "ok" and "warm-up" in step.summary and "2^16" in step.summary
    assert report.get("loss-scale").summary.startswith("settling")
    # gradient underflow is judged at the scale the run trains at, not the initial one
    assert run.train_scale < run.scale and f"scale {mixprec_pow2(run.train_scale)}" in report.get("grad-underflow").summary


def mixprec_pow2(x):
    from mixprec.diagnostics.probes._common import pow2_label

    return pow2_label(x)


def test_fp8_delayed_is_probed_after_its_warm_up_when_its_scales_have_a_history():
    # at step 0 every delayed scale is 1 (no amax history yet) and most gradient values flush to 0
    report = doctor(_fp8_mlp(), "fp8-delayed", "cpu", steps=3)
    fp8 = report.get("fp8-casts")
    assert fp8.status == "ok" and not report.alarming, fp8.summary
    assert report.evidence.fp8_step == 3 and fp8.evidence[0] == "probed after 3 training step(s)"


def test_fp8_unscaled_gradients_that_flush_are_an_alarm():
    report = doctor(_fp8_mlp(), "fp8-unscaled", "cpu", steps=2)
    fp8 = report.get("fp8-casts")
    assert fp8.status == "alarm" and fp8.cause in ("fp8-cast-loss", "fp8-cast-flush") and "grad_output" in fp8.summary


def test_a_flushed_population_is_an_alarm_whatever_the_sqnr():
    from mixprec.diagnostics.checks import Evidence, check_fp8_casts
    from mixprec.fp8 import CastStats
    from mixprec.recipes import resolve_recipe

    def cast(layer, zeros, signal, noise):
        return CastStats(layer, "grad_output", "e4m3", 1000, 1000, zeros, 0, signal, noise, 1.0, 1.0)

    # 99.6% of the values flushed, but the few large ones carry the norm: SQNR 30 dB
    stats = [cast("h.0.mlp", 996, 1000.0, 1.0), cast("h.1.mlp", 0, 1000.0, 1.0)]
    f = check_fp8_casts(Evidence(resolve_recipe("fp8-unscaled", "cpu"), None, None, fp8=stats, fp8_step=1))
    assert (f.status, f.module, f.cause) == ("alarm", "h.0.mlp", "fp8-cast-flush") and "99.6%" in f.summary
    few = [cast("h.0.mlp", 30, 1000.0, 1.0)]  # 3%: a warning
    assert check_fp8_casts(Evidence(resolve_recipe("fp8-unscaled", "cpu"), None, None, fp8=few)).status == "warn"
    none = [cast("h.0.mlp", 0, 1000.0, 1.0)]
    assert check_fp8_casts(Evidence(resolve_recipe("fp8-unscaled", "cpu"), None, None, fp8=none)).status == "ok"


def test_once_the_producer_is_found_later_checks_do_not_contradict_it():
    # issue 33: a forward that multiplies by NaN; the backward of cross_entropy then carries NaN
    # through log_softmax, which checks 1 and 4 took for a log of 0 ("keep log's argument away from 0")
    import torch
    from torch import nn

    class TimesNan(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 16)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)) * float("nan"))

    report = doctor(_regression("times-nan", TimesNan), "fp16-mixed", "cpu", steps=2)
    first = report.get("recipe-step")
    assert first.status == "alarm" and first.cause == "nan-constant"
    fp32, domain = report.get("fp32"), report.get("math-domain")
    assert fp32.status == "alarm" and fp32.cause == "nan-constant"  # fp32 has it too: the same producer
    assert domain.status == "ok" and "nan-constant" in domain.summary
    for f in report.findings:
        assert "log" not in f.fix and f.cause not in ("log-of-zero", "division-by-zero"), (f.check, f.summary, f.fix)


def test_a_loss_computed_in_16_bits_by_the_model_itself_is_seen_before_the_output_cast():
    # the output cast is part of the prepared model's own forward (no hook): doctor reads the model's
    # output before it (PreparedForward.watchers), so a 16-bit loss made at the top level is not hidden
    from torch import nn

    class MeanLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(32, 16)

        def forward(self, x):
            return self.lin(x).pow(2).mean()  # under fp16 autocast: a 16-bit scalar

    task = _regression("own-loss", MeanLoss)
    task.loss_fn = lambda out, _y: out
    f = doctor(task, "fp16-mixed", "cpu", steps=1).get("loss-fp32")
    assert f.status == "alarm" and f.module == "" and "f16" in f.summary
