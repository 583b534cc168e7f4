"""mixprec compare sees fp8: the fp8 recipes TRACK fp32 on the built-in task, a planted bad choice DIVERGES."""

from __future__ import annotations

import pytest

from mixprec.comparison.api import compare

#: the built-in char GPT, shrunk (as tests/compare does) so that six runs take seconds on two busy cores
TINY_CHARLM = {"d_model": 16, "n_layer": 1, "n_head": 2, "seq_len": 16, "batch_size": 4}


@pytest.fixture(scope="module")
def fp8_comparison():
    return compare(recipes=("fp32", "fp8-current", "fp8-delayed", "fp8-unscaled"), steps=60, task_kwargs=TINY_CHARLM,
                   device="cpu", threads=1)


def test_fp8_current_and_delayed_track_fp32_on_the_builtin_task(fp8_comparison):
    for name in ("fp8-current", "fp8-delayed"):
        v = fp8_comparison.verdicts[name]
        assert v.status == "TRACKS", f"{name}: {v.message}"
        assert v.ratio < 0.5  # well inside fp32's noise band


def test_unscaled_e4m3_gradients_diverge_and_the_comparison_says_so(fp8_comparison):
    # every linear in fp8, e4m3 for the gradients and no scaling: gradients of ~1e-3 flush to zero
    # (e4m3's smallest subnormal is 2**-9), so the loss falls far more slowly than fp32's
    v = fp8_comparison.verdicts["fp8-unscaled"]
    assert v.status == "DIVERGES", v.message
    assert fp8_comparison.run_for("fp8-unscaled").loss[-10:].mean() > fp8_comparison.reference.loss[-10:].mean() + 0.1


def test_an_fp8_recipe_that_converts_no_layer_is_an_error_row_not_a_tracks(tmp_path, capsys):
    # the fragile task is one nn.Linear, the model's first and last: torchao's rules keep it in bf16, so
    # fp8-current would have trained as bf16-mixed and printed "TRACKS" under its name
    import json

    from mixprec.comparison.report import print_summary
    from mixprec.tasks import load_task

    result = compare(load_task("fragile", steps=4), ("bf16-mixed", "fp8-current"), out=str(tmp_path), threads=1,
                     seeds=2)
    v = result.verdicts["fp8-current"]
    assert v.status == "ERROR" and "no layer of this model would compute in fp8" in v.message, v.message
    assert result.verdicts["bf16-mixed"].status in ("TRACKS", "UNJUDGED")  # the rest of the comparison ran
    assert result.run_for("fp8-current").steps == 0
    print_summary(result)
    assert "fp8-current ERROR" in capsys.readouterr().out
    data = json.loads((tmp_path / "compare.json").read_text())
    assert data["verdicts"]["fp8-current"]["status"] == "ERROR"


def test_a_run_whose_only_fp8_layer_is_the_lm_head_says_so_in_every_report(tmp_path, capsys):
    import dataclasses
    import html
    import json

    import torch

    from mixprec.comparison.report import print_summary
    from mixprec.recipes import Fp8Spec, get_recipe
    from mixprec.report.terminal import make_console
    from mixprec.tasks import Task
    from test_fp8_recipes import _OnlyTheHead

    def batch(step):
        x = torch.randint(0, 96, (4, 8), generator=torch.Generator().manual_seed(step))
        return x, torch.roll(x, -1, dims=1)

    def loss(out, y):
        return torch.nn.functional.cross_entropy(out.float().flatten(0, 1), y.flatten())

    task = Task(name="head-only", build_model=_OnlyTheHead, get_batch=batch, loss_fn=loss, steps=12)
    recipe = dataclasses.replace(get_recipe("fp8-current"), name="fp8-all", fp8=Fp8Spec(skip_first_last=False))
    with pytest.warns(UserWarning, match="the only layer in fp8 is the LM head"):
        result = compare(task, (recipe,), out=str(tmp_path), threads=1, seeds=2)
    line = "WARNING: recipe 'fp8-all': the only layer in fp8 is the LM head 'lm_head'"
    assert result.verdicts["fp8-all"].message.startswith(line)
    print_summary(result, console=make_console(width=1000))
    out = capsys.readouterr().out
    assert f"fp8-all {result.verdicts['fp8-all'].status}: {line}" in out  # the terminal
    data = json.loads((tmp_path / "compare.json").read_text())
    assert data["verdicts"]["fp8-all"]["message"].startswith(line)  # the JSON
    note = next(r["notes"] for r in data["runs"] if r["recipe"] == "fp8-all")
    assert len(note) == 1 and "the only layer in fp8 is the LM head" in note[0]
    assert line in html.unescape((tmp_path / "compare.html").read_text())  # the HTML
