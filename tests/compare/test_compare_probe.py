"""Found by probing ``mixprec compare`` with users' own tasks: verdicts that tested nothing, a band that
measured no noise, batches the runner mishandled, and errors that did not say what to do."""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from mixprec.cli import main
from mixprec.comparison.api import compare
from mixprec.comparison.runner import check_task
from mixprec.tasks import Task, TaskError, to_device

STEPS = 12


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(32, 8, generator=g)
    return x, (x.sum(-1) > 0).long()


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


def _task(build=_mlp, get_batch=_batch, **kw) -> Task:
    return Task(name="probe-mlp", build_model=build, get_batch=get_batch, loss_fn=F.cross_entropy,
                build_optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2), steps=STEPS, **kw)


class Fp32Inside(nn.Module):
    """Turns autocast off in its forward: under any recipe it computes in fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            return self.net(x.float())


def _seedless() -> nn.Module:
    torch.manual_seed(123)  # ignores the runner's seed: every fp32 seed starts from the same weights
    return _mlp()


def _compare(task: Task, recipes=("bf16-mixed", "fp16-mixed"), **kw):
    return compare(task, recipes, steps=STEPS, device="cpu", timing_rounds=0, threads=1, **kw)


def test_a_recipe_that_computed_nothing_in_16_bits_is_unjudged_not_tracks():
    result = _compare(_task(Fp32Inside))
    for name, low in (("bf16-mixed", "bf16"), ("fp16-mixed", "fp16")):
        assert np.array_equal(result.run_for(name).loss, result.reference.loss)  # the premise: bit for bit
        v = result.verdicts[name]
        assert v.status == "UNJUDGED" and not v.ok, v
        assert f"bit for bit at all {STEPS} steps" in v.message and f"computed in {low}" in v.message
    assert not result.ok


def test_an_all_fp32_policy_reproducing_fp32_is_judged_as_usual():
    result = _compare(_task(), recipes=("p=f32,c=f32,o=f32", "bf16-mixed"))
    same = [name for name in result.verdicts if np.array_equal(result.run_for(name).loss, result.reference.loss)]
    assert same, "an all-fp32 policy should reproduce fp32"
    assert all(result.verdicts[name].status == "TRACKS" for name in same)  # it was asked for fp32: nothing vacuous
    assert result.verdicts["bf16-mixed"].status == "TRACKS"  # a model whose matmuls do run in bf16


def test_a_band_from_fp32_seeds_identical_to_seed_0_is_flagged_in_every_verdict():
    result = _compare(_task(_seedless))
    assert all(np.array_equal(r.loss, result.reference.loss) for r in result.noise)  # the premise
    assert result.band.seeds_identical and not result.band.noise_gap.any()
    for v in result.verdicts.values():
        assert v.message.startswith("WARNING: the fp32 runs from other seeds had the same losses as seed 0"), v.message
        assert "only its floor, 1% of the loss" in v.message
    band = json.loads(result.to_json())["band"]
    assert band["seeds_identical"] is True and "no noise was measured" in band["warning"]


def test_a_measured_band_carries_no_warning():
    result = _compare(_task())
    assert not result.band.seeds_identical and result.band.warning is None
    assert all(not v.message.startswith("WARNING") for v in result.verdicts.values())
    assert json.loads(result.to_json())["band"]["seeds_identical"] is False


Pair = collections.namedtuple("Pair", "x mask")


class Wrapped(collections.abc.Mapping):
    """A mapping that is not a dict (as a Hugging Face BatchEncoding is not)."""

    def __init__(self, data):
        self.data = dict(data)

    def __getitem__(self, k):
        return self.data[k]

    def __iter__(self):
        return iter(self.data)

    def __len__(self):
        return len(self.data)

    def __eq__(self, other):  # as UserDict's: tensor == tensor, whose truth value raises
        return self.data == getattr(other, "data", other)


def test_to_device_keeps_named_tuples_and_moves_every_mapping():
    dev = torch.device("cpu")
    moved = to_device(Pair(torch.ones(2), torch.zeros(2)), dev)  # was TypeError: Pair() missing argument 'mask'
    assert isinstance(moved, Pair) and torch.equal(moved.mask, torch.zeros(2))
    od = to_device(collections.OrderedDict(a=torch.ones(1)), dev)
    assert type(od) is collections.OrderedDict
    w = to_device(Wrapped({"a": torch.ones(1)}), dev)
    assert isinstance(w, Wrapped) and torch.equal(w["a"], torch.ones(1))


def test_check_task_sees_seed_dependent_data_inside_a_mapping_that_is_not_a_dict():
    task = _task(get_batch=lambda step: (Wrapped({"x": torch.randn(4, 8)}), torch.zeros(4, dtype=torch.long)))
    with pytest.raises(TaskError, match="different batches under different global seeds"):  # was: passed silently
        check_task(task)
    check_task(_task(get_batch=lambda step: (Wrapped({"x": _batch(step)[0]}), _batch(step)[1])))  # seeded: fine


def test_batches_on_the_meta_device_are_refused_with_what_to_do():
    task = _task(get_batch=lambda step: tuple(t.to("meta") for t in _batch(step)))
    with pytest.raises(TaskError, match=r"meta device \(\(32, 8\) float32\), which holds no data; return real tensors"):
        check_task(task)  # was: aten::equal's NotImplementedError about fake impls


class KeywordModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = _mlp()

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.net(x * mask)


def make_dict_batches_without_forward() -> Task:
    return _task(KeywordModel, lambda step: ({"x": _batch(step)[0], "mask": torch.ones(32, 8)}, _batch(step)[1]))


def make_dict_batches_with_forward() -> Task:
    t = make_dict_batches_without_forward()
    t.forward = lambda model, batch: model(**batch)
    return t


def test_dict_inputs_without_a_forward_say_to_unpack_them(capsys):
    code = main(["compare", "--task", f"{__name__}:make_dict_batches_without_forward", "--out", "", "--quiet",
                 "--timing-rounds", "0", "--steps", "4"])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and err.count("error:") == 1
    assert "The inputs are a mapping (['mask', 'x'])" in err and "forward=lambda model, batch: model(**batch)" in err
    code = main(["compare", "--task", f"{__name__}:make_dict_batches_with_forward", "--out", "", "--quiet",
                 "--timing-rounds", "0", "--steps", "4"])
    assert code == 0, capsys.readouterr()


USER_TASKS = '''
import torch
from torch import nn
from torch.nn import functional as F
from mixprec.tasks import Task

def _batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(32, 8, generator=g)
    return x, (x.sum(-1) > 0).long()

class Fp32Inside(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    def forward(self, x):
        with torch.autocast(x.device.type, enabled=False):
            return self.net(x.float())

def make_fp32_inside(width="ignored"):
    return Task(name="fp32-inside", build_model=Fp32Inside, get_batch=_batch, loss_fn=F.cross_entropy, steps=8)
'''


def test_cli_exits_1_with_parsable_json_when_a_recipe_tested_nothing(tmp_path):
    (tmp_path / "probe_user_tasks.py").write_text(textwrap.dedent(USER_TASKS))
    proc = subprocess.run(
        [sys.executable, "-m", "mixprec", "compare", "--task", "probe_user_tasks:make_fp32_inside",
         "--task-arg", "width=a=b", "--recipes", "bf16-mixed", "--timing-rounds", "0", "--threads", "1",
         "--out", str(tmp_path / "r"), "--json"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    data = json.loads(proc.stdout)
    assert data["ok"] is False and data["verdicts"]["bf16-mixed"]["status"] == "UNJUDGED"
    assert json.loads((tmp_path / "r" / "compare.json").read_text())["verdicts"]["bf16-mixed"]["status"] == "UNJUDGED"


def test_every_unknown_recipe_is_named_at_once(capsys):
    assert main(["compare", "--recipes", "bf16-mixd", "fp16", "xyz", "--steps", "5"]) == 2
    err = capsys.readouterr().err
    assert "2 recipes cannot run" in err and "'bf16-mixd'. Did you mean 'bf16-mixed'?" in err and "'xyz'" in err
    assert err.count("Expected one of") == 1
