"""mixprec infer-check: the table, --json, exit codes 0 / 1 / 2 and the errors."""

import json

import pytest
import torch

from inference import zoo
from mixprec.cli import SUBCOMMANDS, main

ZOO = zoo.__name__  # "inference.zoo" or "tests.inference.zoo", as pytest imported it
SMALL = ["--task-arg", "d_model=16", "--task-arg", "n_layer=1", "--task-arg", "n_head=2", "--task-arg", "seq_len=8",
         "--batches", "2"]


def test_registered():
    assert SUBCOMMANDS["infer-check"] == "mixprec.inference.cli"


def test_the_built_in_task_agrees_in_a_table_that_fits_80_columns(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["infer-check", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "bf16" in out and "fp16" in out and out.count("AGREE") >= 4  # two rows, two verdict lines
    assert max(len(line) for line in out.splitlines()) <= 80


def test_json_on_stdout(capsys):
    assert main(["infer-check", *SMALL, "--dtype", "fp16", "--mode", "autocast", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert list(data["results"]) == ["fp16"] and data["mode"] == "autocast" and data["verdict"] == "agree"
    assert data["task"]["name"] == "charlm" and data["batches"] == 2
    assert data["results"]["fp16"]["outputs"][0]["sqnr_db"] > 50


def test_a_planted_fp16_overflow_exits_1_and_names_the_module(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["infer-check", "--task", f"{ZOO}:make_overflow", "--batches", "1"]) == 1
    out = capsys.readouterr().out
    assert "BROKEN" in out and "module 'amp' (Linear)" in out and "overflow" in out
    assert "bf16: AGREE" in out


def test_weights_and_training(tmp_path, capsys):
    torch.manual_seed(3)
    model = zoo.Overflow()
    with torch.no_grad():
        model.amp.weight.div_(3e5)  # a version that fits in fp16
    path = tmp_path / "w.pt"
    torch.save(model.state_dict(), path)
    assert main(["infer-check", "--task", f"{ZOO}:make_overflow", "--weights", str(path), "--batches", "1"]) == 0
    capsys.readouterr()
    assert main(["infer-check", *SMALL, "--train-steps", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["task"]["train_steps"] == 2 and data["task"]["first_batch"] == 2  # batches training did not see


@pytest.mark.parametrize("argv, message", [
    (["--task", "nowhere:make"], "cannot import module 'nowhere'"),
    (["--task", "charlm", "--task-arg", "d_model"], "expected KEY=VALUE"),
    (["--task", "charlm", "--task-arg", "d_model=-1"], "d_model must be a positive integer"),
    (["--weights", "/no/such/file.pt"], "no such file"),
    (["--classes", ","], "names no output"),
    (["--device", "warp"], "--device 'warp' cannot be used"),
])
def test_what_cannot_run_exits_2_with_one_line(argv, message, capsys):
    assert main(["infer-check", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_weights_that_do_not_fit_exit_2(tmp_path, capsys):
    path = tmp_path / "w.pt"
    torch.save({"weight": torch.ones(3)}, path)
    assert main(["infer-check", *SMALL, "--weights", str(path)]) == 2
    assert "does not fit the task's model" in capsys.readouterr().err


def test_a_whole_pickled_model_says_to_save_its_state_dict(tmp_path, capsys):
    path = tmp_path / "whole.pt"
    torch.save(torch.nn.Linear(2, 2), path)  # torch.save(model): a pickle weights_only=True refuses
    assert main(["infer-check", *SMALL, "--weights", str(path)]) == 2
    err = capsys.readouterr().err
    assert "torch.save(model.state_dict(), path)" in err and "\x1b[" not in err and "Traceback" not in err


@pytest.mark.parametrize("content", [b"garbage, not a torch.save file", "half"])
def test_a_file_that_is_not_a_torch_save_is_not_called_a_pickled_model(tmp_path, capsys, content):
    path = tmp_path / "w.pt"
    if content == "half":  # a torn save: the first half of a real state_dict file
        torch.save(torch.nn.Linear(2, 2).state_dict(), path)
        content = path.read_bytes()[: path.stat().st_size // 2]
    path.write_bytes(content)
    assert main(["infer-check", *SMALL, "--weights", str(path)]) == 2
    err = capsys.readouterr().err
    torn = content.startswith(b"PK")  # (a torn save is torch.save's zip, damaged; garbage is not its format at all)
    assert ("cannot be read as a torch.save file of tensors" if torn else "is not a torch.save file") in err
    assert "pickled Python objects" not in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_says_so_in_the_words_compare_uses(capsys):
    assert main(["infer-check", *SMALL, "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "CUDA is not available in this torch build or machine. Use --device cpu." in err
    assert "Torch not compiled" not in err


def test_help_has_examples_and_the_gates(capsys):
    with pytest.raises(SystemExit):
        main(["infer-check", "--help"])
    out = capsys.readouterr().out
    assert "mixprec infer-check --task charlm --dtype fp16" in out and "SQNR >= 30 dB" in out and "exit status" in out


# Found by a probe: a text file said "KeyError: 101", an empty one "EOFError: " (nothing), and another
# model's state_dict only the first line of torch's missing/unexpected keys.
@pytest.mark.parametrize("content, message", [
    (b"hello\n", "is not a torch.save file (it starts with b'hello\\n'; torch.save writes a zip archive)"),
    (b"", "is an empty file (0 bytes), not a torch.save file"),
])
def test_a_text_or_empty_file_is_named_for_what_it_is(tmp_path, capsys, content, message):
    path = tmp_path / "w.pt"
    path.write_bytes(content)
    assert main(["infer-check", *SMALL, "--weights", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "KeyError" not in err and "EOFError" not in err and "Traceback" not in err


def test_another_models_state_dict_lists_missing_unexpected_keys_and_shapes(tmp_path, capsys):
    from mixprec.tasks import charlm

    model = charlm.make_task(d_model=16, n_layer=1, n_head=2, seq_len=8).build_model()
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("head")}  # some keys missing
    state["tok.weight"] = torch.zeros(5, 16)  # one of another shape
    state["extra.weight"] = torch.zeros(2)  # one unexpected
    path = tmp_path / "w.pt"
    torch.save(state, path)
    assert main(["infer-check", *SMALL, "--weights", str(path)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "missing (head" in err and "1 unexpected (extra.weight)" in err
    assert "1 of another shape (tok.weight (5, 16) in the file," in err
