"""Probes of ``mixprec bench``: NaN arguments are refused before anything runs; the time-budget line only with a budget."""

import pytest

from mixprec.cli import main


@pytest.mark.parametrize("argv, message", [
    (["--clip", "nan"], "--clip must be >= 0"),
    (["--budget-s", "nan"], "--budget-s must be > 0"),
])
def test_nan_arguments_exit_2_before_the_run(argv, message, capsys, monkeypatch):
    def never(*a, **k):
        raise AssertionError("the benchmark ran")

    monkeypatch.setattr("mixprec.bench.runner.run_bench", never)
    assert main(["bench", "--shape", "tiny", *argv]) == 2
    assert message in capsys.readouterr().err


def test_no_time_budget_line_without_a_budget(capsys, monkeypatch):
    # every variant failed: no round ran, and no budget was given; the budget did not stop anything
    import mixprec.bench.runner as runner

    real = runner.run_bench

    def failing(shape, device, variants, **kw):
        doc = real(shape, device, [], **{**kw, "peaks": False, "memory": False})
        doc["results"] = [{"label": v.label, "recipe": v.recipe, "tf32": v.tf32, "compile": v.compile,
                           "status": "error", "error": "RuntimeError: planted"} for v in variants]
        return doc

    monkeypatch.setattr(runner, "run_bench", failing)
    assert main(["bench", "--shape", "tiny", "--recipes", "fp32", "--reps", "2", "--no-peak"]) == 1
    out = capsys.readouterr().out
    assert "planted" in out and "time budget" not in out
