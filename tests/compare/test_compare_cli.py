"""``mixprec compare`` on the command line: help, bad arguments, exit codes, output modes."""

from __future__ import annotations

import json

import pytest
import torch

from mixprec.cli import main
from mixprec.arguments import split_names
from mixprec.comparison.cli import default_threads, parse_task_args, split_recipes

OVERFLOW = "compare_faults:make_overflow_task"  # fp16 overflows in the forward; fp32 and bf16 are fine


def _run(argv, capsys):
    code = main(["compare", *argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def test_help_describes_options_and_exit_status(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["compare", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for fragment in ("--task", "--recipes", "--steps", "--noise-seeds", "--device", "--out", "--quiet", "--json",
                     "exit status", "MODULE:FUNCTION"):
        assert fragment in text


def test_top_level_help_lists_compare(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "compare" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--steps", "many"], ["--noise-seeds", "-1"], ["--bogus"]])
def test_malformed_arguments_exit_2_from_argparse(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["compare", *argv])
    assert exc.value.code == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--noise-seeds", "1"], "at least 2"),
        (["--recipes", "bf61-mixed"], "Unknown recipe 'bf61-mixed'"),
        (["--recipes", ""], "--recipes names no recipe"),
        (["--recipes", " , "], "--recipes names no recipe"),
        (["--task", "no_such_module_xyz:make_task"], "cannot import module 'no_such_module_xyz'"),
        (["--task", "compare_faults:no_such_factory"], "has no attribute 'no_such_factory'"),
        (["--task", "compare_faults"], "must look like 'package.module:function'"),
        (["--task", "compare_bad_tasks:not_a_task"], "expected mixprec.tasks.Task"),
        (["--task", "compare_bad_tasks:batch_is_not_a_pair"], "expected a pair"),
        (["--task-arg", "oops"], "expected KEY=VALUE"),
        (["--task", OVERFLOW, "--task-arg", "depth=3"], "does not accept arguments ['depth']"),
    ],
)
def test_unusable_input_exits_2_with_a_clear_message(argv, message, capsys, tmp_path):
    code, out, err = _run([*argv, "--out", str(tmp_path / "r")], capsys)
    assert code == 2
    assert message in " ".join(err.split())  # rich may wrap long lines
    assert not (tmp_path / "r").exists()  # failed before writing anything


def test_a_factory_that_raises_is_named_and_traceback_shows_where(capsys):
    code = main(["compare", "--task", "compare_bad_tasks:raises", "--out", ""])
    err = capsys.readouterr().err
    assert code == 2 and "task factory compare_bad_tasks:raises raised RuntimeError: the factory's own bug" in err
    assert "--traceback" in err and "Traceback" not in err
    code = main(["compare", "--task", "compare_bad_tasks:raises", "--out", "", "--traceback"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback (most recent call last)" in err and 'raise RuntimeError("the factory' in err


def test_an_out_dir_under_a_file_exits_2_before_any_run(capsys, tmp_path):
    (tmp_path / "f").write_text("mine")
    code, _, err = _run(["--task", OVERFLOW, "--out", str(tmp_path / "f" / "r")], capsys)
    assert code == 2 and "cannot be created" in " ".join(err.split())
    assert "fp32" not in err  # no run started: the progress lines name each run


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_device_that_cannot_run_exits_2(capsys, tmp_path):
    code, _, err = _run(["--task", OVERFLOW, "--device", "cuda", "--out", str(tmp_path)], capsys)
    assert code == 2 and "CUDA is not available" in " ".join(err.split())


def test_foreign_files_in_out_dir_exit_2(capsys, tmp_path):
    (tmp_path / "compare.png").write_bytes(b"not ours")
    code, _, err = _run(["--task", OVERFLOW, "--out", str(tmp_path)], capsys)
    assert code == 2 and "not written by 'mixprec compare'" in " ".join(err.split())


def test_failing_recipe_exits_1_and_names_it(capsys, tmp_path):
    code, out, err = _run(["--task", OVERFLOW, "--recipes", "bf16-mixed,fp16-mixed", "--steps", "20",
                           "--out", str(tmp_path / "r")], capsys)
    assert code == 1
    assert "NON-FINITE" in out and "fp16-mixed" in out and "TRACKS" in out
    assert (tmp_path / "r" / "compare.html").is_file()
    assert "fp16-mixed" in err  # the progress display


def test_passing_recipes_exit_0_quietly(capsys, tmp_path):
    code, out, err = _run(["--task", OVERFLOW, "--recipes", "bf16-mixed", "--steps", "20", "--quiet",
                           "--out", str(tmp_path / "r")], capsys)
    assert code == 0
    assert out.splitlines()[0].startswith("bf16-mixed: TRACKS")
    assert err == ""  # no progress when quiet


def test_json_mode_prints_parseable_result(capsys, tmp_path):
    code, out, _ = _run(["--task", OVERFLOW, "--recipes", "p=f32,c=bf16,o=f32", "--steps", "20", "--json",
                         "--out", str(tmp_path / "r")], capsys)
    data = json.loads(out)
    assert code == 0 and data["ok"] is True
    assert list(data["verdicts"]) == ["p=f32,c=bf16,o=f32"]
    assert data["files"]["json"].endswith("compare.json")


def test_default_out_dir_is_under_mixprec_report(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, _ = _run(["--task", OVERFLOW, "--recipes", "bf16-mixed", "--steps", "10", "--quiet"], capsys)
    assert code == 0 and (tmp_path / "mixprec-report" / "compare" / "compare.json").is_file()


def test_recipes_split_on_commas_except_inside_policy_strings():
    assert split_recipes(["fp32,bf16-mixed", "p=f32,c=f16", "fp16-mixed"]) == ("fp32", "bf16-mixed", "p=f32,c=f16", "fp16-mixed")
    assert split_recipes(None) is None
    from mixprec.recipes import list_recipes

    every = tuple(r.name for r in list_recipes() if not r.unsafe)
    assert split_recipes(["all"]) == every and "bf16-true-kahan" in every and "fp8-delayed" in every
    assert split_recipes(["bf16-mixed,all"]) == every[1:2] + every[:1] + every[2:]  # each once, first mention first


def test_all_leaves_out_the_unsafe_baselines_which_run_when_named_or_as_baselines():
    # they fail by design: 'compare --recipes all' (a --help example) must show what a user expects
    baselines = {"bf16-pure", "fp16-pure", "fp8-unscaled"}
    assert not baselines & set(split_recipes(["all"]))
    assert set(split_recipes(["baselines"])) == baselines
    assert split_recipes(["all", "fp16-pure"])[-1] == "fp16-pure"


def test_task_args_parse_python_literals_else_strings():
    assert parse_task_args(["d_model=64", "lr=3e-3", "name=abc", "flag=True"]) == {
        "d_model": 64, "lr": 3e-3, "name": "abc", "flag": True,
    }
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_task_args(["1x=3"])


def test_builtin_task_on_cpu_defaults_to_one_thread():
    assert default_threads(None, None, None) == 1
    assert default_threads(None, None, "cpu") == 1
    assert default_threads(None, "pkg.mod:make", "cpu") is None  # a user's model: torch's choice
    assert default_threads(None, None, "cuda") is None
    assert default_threads(3, None, "cpu") == 3


@pytest.mark.parametrize("text, names", [
    ("fp32,bf16-mixed", ["fp32", "bf16-mixed"]),
    ("p=f32,c=bf16,o=f32", ["p=f32,c=bf16,o=f32"]),
    ("fp32,p=f32,c=bf16,o=f32,bf16-true", ["fp32", "p=f32,c=bf16,o=f32", "bf16-true"]),
    ("p=f32,c=bf16,p=bf16,c=bf16", ["p=f32,c=bf16", "p=bf16,c=bf16"]),  # a key again starts the next policy
    ("params=float32,compute=float16, output=float32 ,,fp16-mixed", ["params=float32,compute=float16,output=float32", "fp16-mixed"]),
    ("", []),
])
def test_split_names_keeps_a_policy_string_whole(text, names):
    assert split_names(text) == names
    assert split_recipes([text]) == tuple(names)


def test_two_names_of_one_recipe_run_once_and_say_so():
    import torch

    from mixprec.comparison.api import _resolve_all

    with pytest.warns(UserWarning, match=r"'fp8' and 'fp8-current' name the same recipe \(fp8-current\): it runs once"):
        resolved = _resolve_all(["fp8", "bf16-mixed", "fp8-current"], torch.device("cpu"))
    assert [r.name for r in resolved] == ["fp8-current", "bf16-mixed"]
