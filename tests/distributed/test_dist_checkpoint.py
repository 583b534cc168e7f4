"""Checkpoints through torch.distributed.checkpoint: resume bit for bit on the same world size (2 ranks),
load onto another (3 ranks), refuse what cannot be mapped; and on one process (no process group)."""

import pytest
import torch

import mixprec
from mixprec.distributed import CheckpointError, load_checkpoint, save_checkpoint

CASES = ["fsdp/fp16-mixed", "fsdp/bf16-true", "ddp/bf16-true", "ddp/fp16-mixed"]


@pytest.mark.parametrize("case", CASES)
def test_resume_through_dcp_is_bitwise_the_uninterrupted_run(ckpt_run, case):
    for rank in ckpt_run:
        r = rank["checkpoint"][case]
        assert r["loaded"] == r["saved"]  # parameters (masters), optimizer state, steps, scaler state
        assert r["resumed"] == r["cont"]  # the same losses, scales, skips, norms
        assert r["resumed_state"] == r["uninterrupted"]


def test_the_scale_moved_during_the_checkpointed_run(ckpt_run):
    r = ckpt_run[0]["checkpoint"]["fsdp/fp16-mixed"]
    assert r["saved"]["scaler"]["scale"] != 2.0**8 and r["saved"]["steps"] == 2  # growth_interval 2: it grew


@pytest.mark.parametrize("case", ["fsdp/fp16-mixed", "ddp/bf16-true"])
def test_a_two_rank_checkpoint_loads_onto_three_ranks(ckpt_run, reshard_run, case):
    saved = ckpt_run[0]["checkpoint"][case]["saved"]
    for rank in reshard_run:
        r = rank["reshard"][case]
        assert r["loaded"] == saved  # the full parameters and optimizer state, resharded
        assert r["next"][0]["skipped"] is False and r["next"][0]["loss"] == r["next"][0]["loss"]  # and trains
    assert len({rank["reshard"][case]["digest_after"] for rank in reshard_run}) == 1


def test_a_checkpoint_whose_optimizer_state_cannot_be_mapped_is_refused_on_every_rank(reshard_run):
    messages = {rank["reshard"]["cross"] for rank in reshard_run}
    assert len(messages) == 1
    (msg,) = messages
    assert msg.startswith("CheckpointError") and "parallel='ddp'" in msg and "Resume with" in msg


# ---------------------------------------------------------------------------- one process


def _run(recipe, steps, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    mp = mixprec.MixedPrecision(recipe, "cpu", scaler={"init_scale": 2.0**8, "growth_interval": 1}
                                if recipe.startswith("fp16") else None)
    model = mp.prepare(model)
    opt = torch.optim.AdamW(mp.parameters(model), lr=1e-2)
    return mp, model, opt


def _train(mp, model, opt, steps, start=0):
    for s in range(start, start + steps):
        g = torch.Generator().manual_seed(s)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        with mp.autocast():
            out = model(x)
        mp.step(torch.nn.functional.mse_loss(out, y), opt)
    return [p.detach().clone() for _, p in mp.named_parameters(model)]


@pytest.mark.parametrize("recipe", ["fp16-mixed", "bf16-true-sr"])
def test_save_and_load_checkpoint_work_on_one_process_bit_for_bit(tmp_path, recipe):
    mp, model, opt = _run(recipe, 0)
    _train(mp, model, opt, 2)
    save_checkpoint(tmp_path / "ck", model=model, optimizer=opt, mp=mp)
    want = _train(mp, model, opt, 2, start=2)
    mp2, model2, opt2 = _run(recipe, 0, seed=5)
    load_checkpoint(tmp_path / "ck", model=model2, optimizer=opt2, mp=mp2)
    got = _train(mp2, model2, opt2, 2, start=2)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert mp2.scaler.get_scale() == mp.scaler.get_scale() and mp2._steps == mp._steps == 4


def test_loading_under_another_recipe_says_which(tmp_path):
    mp, model, opt = _run("fp16-mixed", 0)
    _train(mp, model, opt, 1)
    save_checkpoint(tmp_path / "ck", model=model, optimizer=opt, mp=mp)
    mp2, model2, opt2 = _run("bf16-mixed", 0)
    with pytest.raises(CheckpointError, match="saved with recipe 'fp16-mixed'.*uses 'bf16-mixed'"):
        load_checkpoint(tmp_path / "ck", model=model2, optimizer=opt2, mp=mp2)


def test_loading_what_is_not_a_mixprec_checkpoint_says_so(tmp_path):
    mp, model, opt = _run("fp32", 0)
    with pytest.raises(CheckpointError, match="no checkpoint at .*nothing-here"):
        load_checkpoint(tmp_path / "nothing-here", model=model, optimizer=opt, mp=mp)
    torch.save({"x": 1}, tmp_path / "other.pt")
    (tmp_path / "not-dcp").mkdir()
    with pytest.raises(CheckpointError, match="not a mixprec checkpoint"):
        load_checkpoint(tmp_path / "not-dcp", model=model, optimizer=opt, mp=mp)
