"""``mixprec bench``: help, argument errors, and a tiny run end to end."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

import mixprec
from mixprec.cli import main


def test_help_exits_zero_and_shows_examples(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--overhead" in out and "mixprec bench --shape tiny" in out


def test_listing_the_commands_does_not_import_torch():
    src = str(pathlib.Path(mixprec.__file__).parents[1])
    code = "import sys, mixprec.cli; mixprec.cli.build_parser(); print('torch' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": src}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--reps", "0"], "--reps must be >= 1"),
        (["--warmup", "-1"], "--warmup must be >= 0"),
        (["--clip", "-1"], "--clip must be >= 0"),
        (["--plain"], "--plain only applies with --overhead"),
        (["--optimizer", "fused", "foreach"], "only apply with --overhead"),
        (["--shape", "huge"], "Unknown shape 'huge'"),
        (["--recipes", "fp33"], "Unknown recipe 'fp33'"),
        (["--device", "cuda:x"], "Unknown device"),
        (["--budget-s", "0"], "--budget-s must be > 0"),
        (["--overhead", "--budget-s", "60"], "not to --overhead"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(argv, message, capsys):
    assert main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_json_path_that_cannot_be_written_exits_2_before_the_run(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    for path, message in ((tmp_path / "notes.txt" / "out.json", "is not a writable directory"),
                          (tmp_path / "missing" / "out.json", "is not a writable directory"),
                          (tmp_path, "is a directory")):
        assert main(["bench", "--shape", "tiny", "--recipes", "fp32", "--json", str(path)]) == 2
        assert message in capsys.readouterr().err  # was a traceback after the whole benchmark
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_bad_choice_is_refused_by_argparse():
    with pytest.raises(SystemExit) as e:
        main(["bench", "--tf32", "maybe"])
    assert e.value.code == 2


def test_tiny_run_exits_0_and_writes_json(tmp_path, capsys):
    path = tmp_path / "bench.json"
    code = main(["bench", "--shape", "tiny", "--device", "cpu", "--reps", "2", "--warmup", "1", "--recipes", "fp32",
                 "bf16", "--no-peak", "--json", str(path), "--markdown"])
    assert code == 0
    doc = json.loads(path.read_text())
    assert [r["label"] for r in doc["results"]] == ["fp32", "bf16-mixed"]
    assert doc["shape"]["name"] == "tiny" and doc["peaks"] == {}
    out = capsys.readouterr().out
    assert "| variant |" in out and "FLOPs per step" in out


def test_tiny_overhead_run_exits_0_and_writes_json(tmp_path, capsys):
    path = tmp_path / "overhead.json"
    code = main(["bench", "--overhead", "--shape", "tiny", "--device", "cpu", "--reps", "2", "--warmup", "1",
                 "--recipes", "fp32", "--json", str(path)])
    assert code == 0
    doc = json.loads(path.read_text())
    assert doc["kind"] == "mixprec-overhead" and doc["runs"][0]["status"] == "ok"
    assert "mixprec / hand" in capsys.readouterr().out


TINY = ["bench", "--shape", "tiny", "--device", "cpu", "--reps", "1", "--warmup", "0", "--recipes", "fp32",
        "--no-peak", "--no-memory"]


@pytest.mark.parametrize("fault", ["disk-full", "ctrl-c"])
def test_a_json_write_that_fails_part_way_leaves_the_earlier_file_whole(tmp_path, monkeypatch, fault):
    """--json is written aside and renamed in: a full disk mid-write (was: the earlier results truncated
    to half a JSON document) or a Ctrl-C at the rename leaves the earlier file as it was, and no temporary."""
    import builtins

    path = tmp_path / "bench.json"
    path.write_text('{"an": "earlier run"}')
    real_open, real_replace = builtins.open, os.replace

    class HalfWritten:  # the file takes the first bytes, then the disk is full
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            self.f.write(data[: len(data) // 2])
            raise OSError(28, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.f, name)

    def opening(file, mode="r", *a, **k):
        f = real_open(file, mode, *a, **k)
        return HalfWritten(f) if "bench.json" in str(file) and ("w" in mode or "x" in mode) else f

    def interrupted(src, dst):
        raise KeyboardInterrupt

    if fault == "disk-full":
        monkeypatch.setattr(builtins, "open", opening)
        with pytest.raises(OSError, match="No space left"):
            main([*TINY, "--json", str(path)])
    else:
        monkeypatch.setattr(os, "replace", interrupted)
        assert main([*TINY, "--json", str(path)]) == 130  # the CLI's word for a Ctrl-C
    monkeypatch.undo()
    assert path.read_text() == '{"an": "earlier run"}'
    assert os.listdir(tmp_path) == ["bench.json"]
    assert main([*TINY, "--json", str(path)]) == 0  # and a run that completes replaces it
    assert json.loads(path.read_text())["results"][0]["label"] == "fp32" and os.listdir(tmp_path) == ["bench.json"]
