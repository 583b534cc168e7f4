"""MixprecTrainer's ``mixprec.pt``: read back without unpickling code, refused clearly when damaged, and
written atomically (a failure mid-write leaves the previous file whole).

Found by a probe: the resume ran ``torch.load(weights_only=False)`` (a crafted file ran code), a torn
file surfaced torch's raw "PytorchStreamReader failed", and ``on_save`` wrote in place.
"""

from __future__ import annotations

import io
import os
import types

import pytest

pytest.importorskip("transformers", reason="the transformers extra is not installed (pip install -e '.[transformers]')")
pytest.importorskip("accelerate")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from mixprec import MixedPrecision  # noqa: E402
from mixprec.integrations.transformers import (  # noqa: E402
    STATE_FILE, _MixprecCheckpoints, _read_state, _write_state,
)

RECIPES = ["fp32", "bf16-mixed", "fp16-mixed", "fp16-true", "bf16-true", "bf16-true-kahan", "bf16-true-sr",
           "bf16-true-remainder", "fp8-delayed", "fp8-current"]


def _trained(recipe, scale=2.0**16):
    torch.manual_seed(0)
    opts = {"fp8": {"skip_first_last": False}} if recipe.startswith("fp8") else {}
    if recipe.startswith("fp16"):
        opts["scaler"] = {"init_scale": scale}
    mp = MixedPrecision(recipe, "cpu", **opts)
    model = mp.prepare(nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 32)))
    opt = torch.optim.SGD(mp.parameters(model), lr=0.1)
    with mp.autocast():
        loss = model(torch.randn(4, 32)).float().pow(2).mean()
    mp.step(loss, opt)
    return mp


class _Resume:
    """What ``MixprecTrainer.train(resume_from_checkpoint=folder)`` does with ``mixprec.pt``: read and check
    it first (``_read_state``), load it as training begins (the callback's ``on_train_begin``)."""

    def __init__(self, mp, folder) -> None:
        self.mp, self.folder = mp, str(folder)

    def on_train_begin(self, *args) -> None:
        owner = types.SimpleNamespace(mp=self.mp, _mixprec_resume=_read_state(self.folder, self.mp))
        _MixprecCheckpoints(owner).on_train_begin(*args)


def _callback(mp, folder):
    return None, _Resume(mp, folder)


def _save(mp, folder):
    """What the Trainer's checkpoint save does (``MixprecTrainerMixin._save_scaler``)."""
    _write_state(str(folder), mp)


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipes_state_round_trips_through_the_safe_loader(recipe, tmp_path):
    """weights_only=True needs no allowlist: mp.state_dict() is tensors and plain data for every recipe."""
    folder = tmp_path / "checkpoint-3"
    folder.mkdir()
    mp = _trained(recipe)
    _save(mp, folder)
    fresh = _trained(recipe, scale=2.0**10)
    owner, cb = _callback(fresh, folder)
    cb.on_train_begin(None, None, None)
    assert fresh.state_dict()["scaler"] == mp.state_dict()["scaler"] and fresh._steps == mp._steps
    assert os.listdir(folder) == [STATE_FILE]  # (no temporary file left beside it)


def test_a_crafted_state_file_runs_no_code(tmp_path, capsys):
    ran = []

    class Evil:
        def __reduce__(self):
            return (ran.append, ("code ran",))

    mp = _trained("fp16-mixed")
    torch.save({"recipe": "fp16-mixed", "scaler": mp.scaler.state_dict(), "steps": 0, "x": Evil()}, tmp_path / STATE_FILE)
    before = mp.state_dict()
    with pytest.raises(RuntimeError, match=r"mixprec\.pt is damaged and cannot be loaded \(it holds more than tensors"):
        _callback(mp, tmp_path)[1].on_train_begin(None, None, None)
    assert ran == [] and mp.state_dict() == before


@pytest.mark.parametrize("damage", ["truncated", "empty", "text"])
def test_a_damaged_state_file_is_named_and_says_what_to_do(damage, tmp_path):
    mp = _trained("fp16-true")
    path = tmp_path / STATE_FILE
    torch.save(mp.state_dict(), path)
    if damage == "truncated":
        os.truncate(path, os.path.getsize(path) // 2)
    else:
        path.write_bytes(b"" if damage == "empty" else b"hello\n")
    with pytest.raises(RuntimeError) as info:
        _callback(mp, tmp_path)[1].on_train_begin(None, None, None)
    text = str(info.value)
    assert str(path) in text and "is damaged" in text and "Resume from an earlier checkpoint" in text


def test_a_save_that_fails_midway_leaves_the_previous_file_whole(tmp_path, monkeypatch):
    """A fault as it happens: torch.save raising after it wrote part of the file (a full disk)."""
    folder = tmp_path / "checkpoint-2"
    folder.mkdir()
    mp = _trained("fp16-mixed")
    _save(mp, folder)
    old = (folder / STATE_FILE).read_bytes()
    real_save = torch.save

    def torn(obj, f, *a, **k):
        buf = io.BytesIO()
        real_save(obj, buf, *a, **k)
        if isinstance(f, (str, os.PathLike)):
            with open(f, "wb") as out:
                out.write(buf.getvalue()[:100])
        else:
            f.write(buf.getvalue()[:100])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", torn)
    mp._steps += 5
    with pytest.raises(OSError, match="No space left"):
        _save(mp, folder)
    assert (folder / STATE_FILE).read_bytes() == old and os.listdir(folder) == [STATE_FILE]
