"""The seam between ``MixedPrecision`` and a parallel strategy (``mixprec.seam``), on one process.

A recording strategy stands in for DDP/FSDP2: the facade must call it at the points
``mixprec.seam.Strategy`` lists, in the step's order, and hand it what it needs; and the strategy
modules must not reach into the facade (no private attribute of the ``MixedPrecision`` they are
handed, no writes to it).
"""

import ast
from pathlib import Path

import torch
from torch import nn

import mixprec
from mixprec.seam import Local, Plugged

SRC = Path(__file__).resolve().parents[2] / "src" / "mixprec" / "distributed"
STRATEGY_MODULES = ("prepare.py", "ddp.py", "fsdp.py", "runtime.py", "alignment.py")


class Recorder:
    """A strategy that communicates nothing and writes down every call."""

    def __init__(self):
        self.calls = []

    def local_module(self, model):
        self.calls.append("local_module")
        return model

    def backward(self, loss, *, boundary, accumulating, retain_graph):
        self.calls.append(f"backward(boundary={boundary})")
        loss.backward(retain_graph=retain_graph)

    def reduce_master_grads(self, named):
        self.calls.append("reduce_master_grads")

    def share_skip_decision(self, scaler, optimizers, steps):
        self.calls.append(f"share_skip_decision(steps={steps})")
        scaler.share_skip_decision(optimizers)

    def clip_grad_norm_(self, params, max_norm, norm_type):
        self.calls.append("clip_grad_norm_")
        return nn.utils.clip_grad_norm_(params, max_norm or float("inf"), norm_type=norm_type)

    def discard(self, steps):
        self.calls.append(f"discard(steps={steps})")
        return 0

    def stepped(self):
        self.calls.append("stepped")

    def loaded(self):
        self.calls.append("loaded")

    def state(self):
        return {"mode": "recorder", "world_size": 1}

    def describe(self):
        return "a recorder"


def test_the_facade_calls_the_strategy_at_the_points_of_the_step(monkeypatch):
    import mixprec.distributed.prepare as prepare

    seen = {}
    recorder = Recorder()

    def plug(model, spec, local):
        assert isinstance(local, Local) and spec == "recorder"
        seen.update(recipe=local.recipe.name, accumulate=local.accumulate, masters=local.masters)
        return Plugged(local.apply(model), recorder, local.masters)

    monkeypatch.setattr(prepare, "plug", plug)
    mp = mixprec.MixedPrecision("bf16-true", "cpu", accumulate=2)
    torch.manual_seed(0)
    model = mp.prepare(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)), parallel="recorder")
    assert seen["recipe"] == "bf16-true" and seen["accumulate"] == 2 and seen["masters"] is mp.masters
    assert model[0].weight.dtype == torch.bfloat16  # the recipe applied through Local.apply
    opt = torch.optim.SGD(mp.parameters(model), lr=0.1)
    recorder.calls.clear()
    for _ in range(2):
        with mp.autocast():
            loss = model(torch.ones(3, 4)).float().sum()
        mp.step(loss, opt, max_grad_norm=1.0)
    assert recorder.calls == ["backward(boundary=False)", "backward(boundary=True)", "reduce_master_grads",
                              "share_skip_decision(steps=0)", "clip_grad_norm_", "stepped"]
    recorder.calls.clear()
    mp.reset(opt)
    state = mp.state_dict()
    assert state["parallel"] == {"mode": "recorder", "world_size": 1}
    mp.load_state_dict(state)
    assert recorder.calls == ["discard(steps=1)", "loaded"]
    assert mp.describe().count("a recorder") == 1


def _private_uses(path: Path) -> list[str]:
    """``mp._anything`` reads and ``mp.anything = ...`` writes, for the name the facade's view goes by."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("mp", "local"):
            if node.attr.startswith("_"):
                found.append(f"{path.name}:{node.lineno} {node.value.id}.{node.attr}")
            if isinstance(node.ctx, ast.Store):
                found.append(f"{path.name}:{node.lineno} writes {node.value.id}.{node.attr}")
    return found


def test_the_strategy_does_not_reach_into_the_facade():
    found = [u for name in STRATEGY_MODULES for u in _private_uses(SRC / name)]
    assert found == []
