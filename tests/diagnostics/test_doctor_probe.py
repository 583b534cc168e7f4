"""Found by probing ``mixprec doctor`` with users' own tasks: JSON that was not JSON, a task that does not
train in fp32 reported as an alarm (exit 1) instead of a task that cannot be used (exit 2), and no way to
pass the factory its arguments."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

import torch
from torch import nn
from torch.nn import functional as F

from mixprec.cli import main
from mixprec.diagnostics.doctor import doctor
from mixprec.tasks import Task


def _strict_json(text: str):
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(16, 8, generator=g)
    return x, (x.sum(-1) > 0).long()


class Overflow(nn.Module):
    """Features near 3e7 in the forward: fp16 overflows (inf, then NaN losses); fp32 and bf16 do not."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 2)
        with torch.no_grad():
            self.l1.weight.mul_(3000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l1(x)
        return self.l2(h * h / 1000)


def make_overflow() -> Task:
    return Task(name="probe-overflow", build_model=Overflow, get_batch=_batch, loss_fn=F.cross_entropy, steps=3)


def make_float_loss(width: int = 4) -> Task:
    return Task(name="probe-float-loss", build_model=lambda: nn.Linear(8, 2), get_batch=_batch,
                loss_fn=lambda out, y: float(F.cross_entropy(out, y)), steps=3)


def make_sized(width: int = 4, tag: str = "") -> Task:
    assert isinstance(width, int) and tag == "a=b", (width, tag)  # --task-arg: numbers parsed, '=' kept in values
    return Task(name=f"probe-width-{width}", build_model=lambda: nn.Sequential(nn.Linear(8, width), nn.Linear(width, 2)),
                get_batch=_batch, loss_fn=F.cross_entropy, steps=3)


def test_doctor_json_is_strict_json_when_losses_are_nan(tmp_path, capsys):
    report = doctor(make_overflow(), device="cpu", steps=2)
    assert any(v != v for v in report.evidence.run.losses)  # the premise: NaN losses under fp16-mixed
    data = _strict_json(report.to_json())  # was: bare NaN tokens, which JSON.parse and strict parsers refuse
    assert data["alarming"] is True and None in data["runs"]["fp16-mixed"]["losses"]
    written = report.write(tmp_path / "r")
    assert _strict_json(written["doctor.json"].read_text())["alarming"] is True
    code = main(["doctor", "--task", f"{__name__}:make_overflow", "--steps", "2", "--out", "", "--json"])
    assert code == 1 and _strict_json(capsys.readouterr().out)["alarming"] is True


def test_a_task_whose_fp32_step_raises_exits_2_with_one_line(capsys):
    code = main(["doctor", "--task", f"{__name__}:make_float_loss", "--out", ""])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2, err  # was 1, with 'alarming findings' and probes skipped below them
    assert err.count("error:") == 1 and "Traceback" not in err
    assert "its step fails in plain fp32 (TypeError: step() expects the loss as a tensor, got float)" in err


def test_doctor_takes_task_args(capsys):
    code = main(["doctor", "--task", f"{__name__}:make_sized", "--task-arg", "width=6", "--task-arg", "tag=a=b",
                 "--steps", "1", "--out", "", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert _strict_json(out)["task"] == "probe-width-6"
    assert main(["doctor", "--task", f"{__name__}:make_sized", "--task-arg", "depth=2", "--out", ""]) == 2
    assert "does not accept arguments ['depth']" in capsys.readouterr().err
    assert main(["doctor", "--task-arg", "no-equals", "--out", ""]) == 2
    assert "expected KEY=VALUE" in capsys.readouterr().err


RAISING = '''
import torch
from torch import nn
from torch.nn import functional as F
from mixprec.tasks import Task

def _get(step):
    raise RuntimeError(f"batch {step} is missing")

def make():
    return Task(name="raising", build_model=lambda: nn.Linear(8, 2), get_batch=_get, loss_fn=F.cross_entropy)
'''


def test_cli_names_where_the_tasks_own_code_raised_in_fp32(tmp_path):
    (tmp_path / "probe_doctor_raising.py").write_text(textwrap.dedent(RAISING))
    proc = subprocess.run([sys.executable, "-m", "mixprec", "doctor", "--task", "probe_doctor_raising:make", "--out", ""],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    err = " ".join(proc.stderr.split())
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in err and "RuntimeError: batch 0 is missing" in err
    assert "probe_doctor_raising.py:8in_get" in "".join(err.split())  # rich may break a long path anywhere


class Fp32Inside(nn.Module):
    """A forward that turns autocast off: under a 16-bit recipe nothing of it runs in 16 bits."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return self.net(x.float())


@pytest.mark.parametrize("recipe", ["fp16-mixed", "bf16-mixed"])
def test_a_model_that_runs_nothing_in_16_bits_is_a_warning_not_ok(recipe):
    task = Task(name="probe-fp32-inside", build_model=Fp32Inside, get_batch=_batch, loss_fn=F.cross_entropy, steps=3)
    found = {f.check: f for f in doctor(task, recipe=recipe, device="cpu", steps=2).findings}["activation-range"]
    assert found.status == "warn" and found.cause == "no-16-bit-compute" and "nothing of this model ran in" in found.summary
    plain = Task(name="probe-plain", build_model=lambda: nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2)),
                 get_batch=_batch, loss_fn=F.cross_entropy, steps=3)
    found = {f.check: f for f in doctor(plain, recipe=recipe, device="cpu", steps=2).findings}["activation-range"]
    assert found.cause != "no-16-bit-compute"
