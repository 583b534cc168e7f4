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
    assert err.startswith("error: KeyError: 'config missing' (raised at")
    assert "doctor_raising_task.py:2inmake)" in "".join(err.split())  # rich may break a long path anywhere
    assert main(["doctor", "--task", "doctor_broken_module:make", "--out", ""]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: SyntaxError") and "Traceback" not in err


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
