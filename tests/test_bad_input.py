"""Bad input, as a new user gives it: each case a clear one-line error (exit 2 for the CLI) that says
what to do, or the right thing done. One table per surface; every case once seen misbehaving."""

from __future__ import annotations

import pytest

from mixprec.cli import main

# (argv, expected exit code, a fragment of the message on stderr)
CLI_CASES = [
    # unknown recipes: a suggestion, and no policy-parser tail for a name with no '='
    (["compare", "--recipes", "bf61-mixed", "--out", ""], 2, "Did you mean 'bf16-mixed'?"),
    (["compare", "--recipes", "bf16_mixed", "--out", ""], 2, "Did you mean 'bf16-mixed'?"),
    (["memory", "--params", "7B", "--recipe", "fp16_true"], 2, "Did you mean 'fp16-true'?"),
    # task arguments: the argument named, its type shown
    (["compare", "--task-arg", "d_model=abc", "--out", ""], 2, "d_model must be a positive integer, got 'abc'"),
    (["compare", "--task-arg", "d_model=0", "--out", ""], 2, "with the arguments d_model=0 (int)"),
    (["compare", "--task-arg", "d_model=30", "--task-arg", "n_head=4", "--out", ""], 2,
     "d_model (30) must be a multiple of n_head (4)"),
    (["compare", "--task", "nosuchtask", "--out", ""], 2, "or be a built-in task: charlm, fragile"),
    # output directories that cannot be written: said before any training
    (["compare", "--out", "/proc/mixprec-x"], 2, "cannot be written"),
    (["doctor", "--out", "/proc/mixprec-x"], 2, "cannot be written"),
    # memory: shapes and counts that cannot exist
    (["memory", "--params", "7B", "--batch", "1", "--seq", "8", "--d-model", "4096", "--layers", "2", "--heads", "3"],
     2, "not a multiple of --heads 3"),
    (["memory", "--params", "0"], 2, "must be >= 1"),
    (["memory", "--params", "-7B"], 2, "must be >= 1"),
    (["memory", "--params", "1e400"], 2, "no model is that large"),
    # lint: a path with no Python file checked nothing, and says so
    (["lint", "/dev/null"], 2, "no Python file to check there"),
    # compare on several processes: options that cannot apply, more ranks than the machine has, a recipe FSDP2
    # refuses (said before any rank starts)
    (["compare", "--nproc", "100000", "--out", ""], 2, "or pass --force-nproc"),
    (["compare", "--parallel", "fsdp", "--out", ""], 2, "without --nproc every run trains on one process"),
    (["compare", "--nproc", "1", "--parallel", "ddp", "--out", ""], 2, "Add --nproc 2 (or more), or drop --parallel"),
    # found by qa: accepted and ignored
    (["compare", "--force-nproc", "--out", ""], 2, "without --nproc (N > 1) every run trains on one process. Add --nproc N, or drop --force-nproc"),
    (["compare", "--backend", "jax", "--force-nproc", "--out", ""], 2, "drop --force-nproc"),
    (["compare", "--backend", "jax", "--nproc", "2", "--out", ""], 2, "--backend jax has no data-parallel runs"),
    (["compare", "--backend", "jax", "--parallel", "fsdp", "--out", ""], 2, "--backend jax has no data-parallel runs"),
    (["compare", "--nproc", "2", "--force-nproc", "--parallel", "fsdp", "--recipes", "bf16-true-kahan", "--out", ""],
     2, "--parallel fsdp: recipe 'bf16-true-kahan' keeps no fp32 master"),
    # memory: no per-rank plan for a set-up prepare() refuses
    (["memory", "--params", "7B", "--world-size", "8", "--parallel", "fsdp", "--recipe", "bf16-true-kahan"], 2,
     "prepare(parallel='fsdp') refuses it, so there is no per-rank plan"),
    # bench: a recipe with no hand-written torch.amp twin
    (["bench", "--overhead", "--recipes", "bf16-true", "--shape", "tiny"], 2, "has no hand-written twin"),
]


@pytest.mark.parametrize("argv, code, fragment", CLI_CASES, ids=[" ".join(c[0])[:60] for c in CLI_CASES])
def test_cli_bad_input_is_one_clear_error(argv, code, fragment, capsys):
    assert main(argv) == code
    captured = capsys.readouterr()
    assert fragment in captured.err, captured.err
    assert "Traceback" not in captured.err + captured.out


def test_compare_out_empty_means_no_report_as_for_doctor(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["compare", "--steps", "2", "--noise-seeds", "2", "--recipes", "bf16-mixed", "--out", "",
                 "--quiet", "--task-arg", "d_model=16", "--task-arg", "n_layer=1", "--task-arg", "seq_len=8"]) == 0
    assert list(tmp_path.iterdir()) == []  # nothing written, nowhere
    assert "report:" not in capsys.readouterr().out


def test_compare_results_survive_an_output_directory_that_fails_after_training(tmp_path, monkeypatch):
    import mixprec.comparison.report as report
    from mixprec import compare
    from mixprec.tasks import load_task

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(report, "write_report", fail)
    task = load_task("fragile", steps=3)
    with pytest.warns(RuntimeWarning, match="No space left on device"):
        result = compare(task, ("bf16-mixed",), out=str(tmp_path / "r"), threads=1)
    assert result.write_error and result.verdicts["bf16-mixed"].status in ("TRACKS", "DIVERGES")
    monkeypatch.undo()
    files = result.write(str(tmp_path / "elsewhere"))
    assert set(files) == {"html", "png", "json", "csv"} and result.write_error is None


def test_compare_with_a_model_that_is_nan_in_fp32_says_fp32_itself_is_non_finite(tmp_path):
    import torch
    from torch import nn

    from mixprec import compare
    from mixprec.comparison.report import summary_rows
    from mixprec.tasks import Task

    class NanModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, x):
            return self.lin(x) * float("nan")

    def batch(step):
        g = torch.Generator().manual_seed(step)
        return torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)

    task = Task(name="nan", build_model=NanModel, get_batch=batch, loss_fn=nn.functional.mse_loss, steps=4)
    result = compare(task, ("bf16-mixed", "fp16-mixed"), out=str(tmp_path), threads=1)
    rows = {r["recipe"]: r for r in summary_rows(result)}
    for name in ("bf16-mixed", "fp16-mixed"):  # recipes that never ran still get a row and the reason
        assert rows[name]["verdict"] == "UNJUDGED"
        assert "fp32 itself" in rows[name]["message"] and "at step 1" in rows[name]["message"]
    html = (tmp_path / "compare.html").read_text()
    assert "fp32 itself (fp32) has a non-finite loss at step 1" in html


def test_a_policy_whose_output_is_16_bit_is_named_with_its_output_dtype():
    from mixprec import compare
    from mixprec.tasks import load_task

    with pytest.warns(UserWarning, match=r"means p=f32,c=bf16,o=bf16.*write o=f32: p=f32,c=bf16,o=f32"):
        compare(load_task("fragile", steps=2), ("p=f32,c=bf16",), threads=1)


# ---------------------------------------------------------------------------- the Python API

def _mp_and_model(recipe="bf16-true"):
    import torch
    from torch import nn

    from mixprec import MixedPrecision

    mp = MixedPrecision(recipe, "cpu")
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    return mp, model, torch


def _step_without_prepare():
    mp, model, torch = _mp_and_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mp.step(model(torch.ones(2, 4)).sum(), opt)


def _optimizer_over_another_module():
    mp, model, torch = _mp_and_model()
    model = mp.prepare(model)
    other = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(other.parameters(), lr=0.1)
    with mp.autocast():
        loss = model(torch.ones(2, 4)).float().sum()
    mp.step(loss, opt)


def _step_with_none():
    mp, model, torch = _mp_and_model("bf16-mixed")
    mp.step(model(torch.ones(2, 4)).sum(), None)


def _scheduler_is_a_string():
    mp, model, torch = _mp_and_model("bf16-mixed")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mp.step(model(torch.ones(2, 4)).sum(), opt, scheduler="cosine")


def _load(state):
    def run():
        mp, _, _ = _mp_and_model("fp16-mixed")
        mp.load_state_dict(state)
    return run


def _masters_of_another_shape():
    import torch

    from mixprec import MixedPrecision

    def mp_for(width):
        mp = MixedPrecision("bf16-true", "cpu")
        mp.prepare(torch.nn.Sequential(torch.nn.Linear(width, 32), torch.nn.Linear(32, 4)))
        return mp

    mp_for(32).load_state_dict(mp_for(64).state_dict())


def _scaler(**kwargs):
    def run():
        from mixprec import GradScaler
        GradScaler("cpu", **kwargs)
    return run


def _update(new_scale):
    def run():
        import torch

        from mixprec import GradScaler

        s = GradScaler("cpu")
        s.scale(torch.ones(()))
        s.update(new_scale=new_scale)
    return run


def _torch_scaler_state():
    import torch
    return torch.amp.GradScaler("cpu").state_dict() | {"scale": 8.0, "_growth_tracker": 0}


def _compare_progress(value, name="progress"):
    def run():
        from mixprec import compare
        compare("fragile", ("bf16-mixed",), steps=2, threads=1, **{name: value})
    return run


def _explain_progress():
    from mixprec import explain
    explain("fragile", "bf16-pure", device="cpu", steps=2, progress=True)


API_CASES = [
    (_step_without_prepare, RuntimeError, "call model = mp.prepare(model) before training"),
    (_optimizer_over_another_module, ValueError, "holds none of the parameters of the prepared Sequential"),
    (_step_with_none, TypeError, "expects torch.optim.Optimizer instances"),
    (_scheduler_is_a_string, TypeError, "scheduler must be an lr scheduler"),
    (_load({"hello": 1}), ValueError, "not a MixedPrecision state dict"),
    (_load([1, 2]), TypeError, "expects the dict mp.state_dict() returned"),
    (_load("torch-scaler"), ValueError, "mp.scaler.load_state_dict(state)"),
    (_masters_of_another_shape, ValueError, "does not fit parameter '0.weight': checkpoint 32x64, model 32x32"),
    (_scaler(init_scale=0.0), ValueError, "init_scale must be a finite number > 0"),
    (_scaler(init_scale=float("inf")), ValueError, "init_scale must be a finite number > 0"),
    (_update(8), TypeError, "write 8.0"),
    (_update(True), TypeError, "Got bool True"),
    (_update(0.0), ValueError, "new_scale must be a finite float > 0"),
    # found by qa: progress=True ('show progress') trained, then raised "'bool' object is not callable"
    (_compare_progress(True), TypeError, "progress=True: need a function"),
    (_compare_progress("rich", "on_run"), TypeError, "on_run='rich': need a function"),
    (_compare_progress(100000, "nproc"), ValueError, "or pass --force-nproc (compare(force_nproc=True))"),
    (_compare_progress(0, "nproc"), ValueError, "nproc=0: need a positive integer"),
    (_compare_progress("yes", "force_nproc"), TypeError, "force_nproc='yes': need True or False"),
    (_explain_progress, TypeError, "progress=True: need a function called with each line (print works)"),
]


@pytest.mark.parametrize("case, error, fragment", API_CASES, ids=[c[0].__qualname__ for c in API_CASES])
def test_api_bad_input_is_a_clear_error(case, error, fragment):
    if case.__qualname__.startswith("_load") and "torch-scaler" in repr(case.__closure__[0].cell_contents):
        case = _load(_torch_scaler_state())
    with pytest.raises(error) as info:
        case()
    assert fragment in str(info.value)


def test_load_state_dict_with_strict_false_still_refuses_what_is_not_a_state_dict():
    mp, _, _ = _mp_and_model("fp16-mixed")
    with pytest.raises(ValueError, match="not a MixedPrecision state dict"):
        mp.load_state_dict({"hello": 1}, strict=False)


def test_lint_of_an_empty_directory_says_nothing_was_checked(tmp_path, capsys):
    assert main(["lint", str(tmp_path)]) == 2
    assert "nothing was checked" in capsys.readouterr().err
    (tmp_path / "a.py").write_text("from torch.cuda.amp import GradScaler\n")
    (tmp_path / "b.py").write_text("x = 1\n")
    assert main(["lint", str(tmp_path)]) == 1
    assert "1 problem in 1 file (2 checked)" in capsys.readouterr().out
