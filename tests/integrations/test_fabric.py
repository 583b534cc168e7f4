"""MixprecFabricPrecision, the Lightning Fabric plugin: the same numbers as mp.step by hand (per
step and at the end, bitwise), skips that hold the scheduler, accumulation windows, bitwise resume
through fabric.save/load, and clear refusals."""

from __future__ import annotations

import math
import warnings

import pytest

L = pytest.importorskip("lightning", reason="the lightning extra is not installed (pip install -e '.[lightning]')")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from integ_helpers import (  # noqa: E402
    batches, bitwise, hand_loop, make_data, make_net, make_optimizer, make_scheduler, params_equal,
)
from mixprec.integrations.fabric import MixprecFabricPrecision  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning:lightning.*",
                                        "ignore::FutureWarning")


def fabric_run(precision, data, *, clip=None, accumulate=1, epochs=1, connect=False, state_path=None, resume=None,
               steps=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[precision])
        net = make_net()
        opt = make_optimizer(net.parameters())
        model, opt = fabric.setup(net, opt)
    if connect:
        precision.connect(opt)
    sched = precision.skip_aware(make_scheduler(opt.optimizer))
    if resume is not None:
        fabric.load(resume, {"model": model, "optimizer": opt, "mixprec": precision, "scheduler": sched})
    losses, stats = [], []
    for i, (x, y) in enumerate(batches(*data, epochs=epochs)):
        loss = F.mse_loss(model(x), y) / accumulate
        losses.append(loss.detach())
        fabric.backward(loss)
        if (i + 1) % accumulate:
            continue
        norm = None
        if clip is not None:
            if precision.mp.masters is not None:
                norm = precision.clip_grad_norm_(opt, clip)
            else:  # Fabric's own clip (torch's, on the gradients the plugin unscaled)
                norm = fabric.clip_gradients(model, opt, max_norm=clip)
        opt.step()
        opt.zero_grad()
        sched.step()
        stats.append(precision.last_stats.to_dict())
        if norm is not None:
            stats[-1]["plugin_grad_norm"] = stats[-1]["grad_norm"]  # what the plugin recorded
            stats[-1]["grad_norm"] = float(norm)
        if steps is not None and len(stats) == steps:
            break
    if state_path is not None:
        fabric.save(state_path, {"model": model, "optimizer": opt, "mixprec": precision, "scheduler": sched})
    return model, opt, sched, losses, stats


@pytest.mark.parametrize("recipe", ["fp32", "bf16-mixed", "fp16-mixed", "bf16-true", "bf16-true-kahan"])
def test_thirty_steps_equal_mp_step_by_hand_bitwise(recipe):
    data = make_data()
    precision = MixprecFabricPrecision(recipe, device="cpu")
    model, opt, sched, losses, stats = fabric_run(precision, data, clip=0.5)
    ref, ref_steps, ref_sched = hand_loop(recipe, *data, max_grad_norm=0.5)
    assert len(stats) == len(ref_steps) == 30
    assert bitwise(torch.stack(losses), torch.tensor([s["loss"] for s in ref_steps]))
    assert [s["grad_norm"] for s in stats] == [s["grad_norm"] for s in ref_steps]
    assert params_equal(model.module if hasattr(model, "module") else model, ref)
    assert sched.last_epoch == ref_sched.last_epoch == 30
    if recipe.startswith("bf16-true"):  # 16-bit storage: Fabric's optimizer steps the fp32 masters
        net = model.module
        assert net[0].weight.dtype == torch.bfloat16 and net[1].weight.dtype == torch.float32
        assert all(p.dtype == torch.float32 for g in opt.optimizer.param_groups for p in g["params"])


def test_fp16_overflow_skips_the_step_and_holds_the_scheduler():
    data = make_data(overflow_at=(3,))
    precision = MixprecFabricPrecision("fp16-mixed", device="cpu")
    model, opt, sched, _, stats = fabric_run(precision, data)
    ref, ref_steps, ref_sched = hand_loop("fp16-mixed", *data)
    assert [s["skipped"] for s in stats].count(True) >= 1 and stats[3]["skipped"]
    assert [s["scale"] for s in stats] == [s["scale"] for s in ref_steps]
    assert sched.last_epoch == ref_sched.last_epoch < 30  # skipped steps did not advance it
    assert params_equal(model.module, ref)


@pytest.mark.parametrize("options", [{}, {"track_grad_norm": True}, {"scaler": {"hysteresis": 2}}])
def test_the_documented_loop_with_fabric_clip_gradients_survives_an_overflow(options):
    # issue 29.4: fabric.clip_gradients runs torch's clip with error_if_nonfinite=True (its default), so the
    # step the scaler was about to skip raised "The total norm of order 2.0 for gradients ... is non-finite"
    data = make_data(overflow_at=(3, 11))
    precision = MixprecFabricPrecision("fp16-mixed", device="cpu", **options)
    model, _, sched, losses, stats = fabric_run(precision, data, clip=1.0)
    ref_options = {"scaler": options["scaler"]} if "scaler" in options else {}
    ref, ref_steps, ref_sched = hand_loop("fp16-mixed", *data, max_grad_norm=1.0, **ref_options)
    assert len(stats) == 30 and stats[3]["skipped"] and stats[11]["skipped"]
    assert [s["skipped"] for s in stats] == [s["skipped"] for s in ref_steps]
    assert [s["scale"] for s in stats] == [s["scale"] for s in ref_steps]
    taken = [i for i, s in enumerate(stats) if not s["skipped"]]  # the norms Fabric returned on taken steps
    assert [stats[i]["grad_norm"] for i in taken] == [ref_steps[i]["grad_norm"] for i in taken]
    assert all(stats[i]["grad_norm"] == 0.0 for i in range(30) if i not in taken)  # (zeroed: skipped anyway)
    if options.get("track_grad_norm"):  # what the plugin records is the true norm: inf on a skipped step
        got, want = [s["plugin_grad_norm"] for s in stats], [s["grad_norm"] for s in ref_steps]
        assert bitwise(torch.tensor(got), torch.tensor(want)) and not math.isfinite(got[3])
    assert params_equal(model.module, ref) and sched.last_epoch == ref_sched.last_epoch


@pytest.mark.parametrize("recipe", ["fp16-mixed", "bf16-true"])
def test_several_backwards_before_a_step_are_one_window_of_mp_step(recipe):
    data = make_data()
    precision = MixprecFabricPrecision(recipe, device="cpu")
    model, _, _, _, stats = fabric_run(precision, data, accumulate=3, clip=1.0, connect=True)
    ref, ref_steps, _ = hand_loop(recipe, *data, accumulate=3, max_grad_norm=1.0)
    assert len(stats) == len(ref_steps) == 10
    assert [s["grad_norm"] for s in stats] == [s["grad_norm"] for s in ref_steps]
    assert params_equal(model.module, ref)


def test_a_storage_recipe_with_several_backwards_before_its_first_step_asks_for_connect():
    precision = MixprecFabricPrecision("bf16-true", device="cpu")
    with pytest.raises(RuntimeError, match=r"precision.connect\(optimizer\)"):
        fabric_run(precision, make_data(), accumulate=2)


@pytest.mark.parametrize("recipe", ["fp16-mixed", "bf16-true-sr"])
def test_resume_through_fabric_save_and_load_continues_bitwise(recipe, tmp_path):
    data = make_data(overflow_at=(20,))
    whole = fabric_run(MixprecFabricPrecision(recipe, device="cpu"), data, epochs=2)
    path = tmp_path / "ckpt"
    fabric_run(MixprecFabricPrecision(recipe, device="cpu"), data, epochs=1, state_path=path)
    # the second epoch, resumed from the checkpoint in a fresh Fabric (make_net's init is overwritten)
    if recipe != "fp16-mixed":  # 16-bit storage: the optimizer must be on the masters before its state loads
        with pytest.raises(ValueError, match=r"precision.connect\(optimizer\) right after fabric.setup"):
            fabric_run(MixprecFabricPrecision(recipe, device="cpu"), data, resume=path)
    resumed_model, _, _, _, resumed_stats = fabric_run(MixprecFabricPrecision(recipe, device="cpu"), data, resume=path,
                                                       connect=True)
    assert bitwise(torch.tensor([s["loss"] for s in resumed_stats]), torch.tensor([s["loss"] for s in whole[4][30:]]))
    assert [(s["scale"], s["skipped"]) for s in resumed_stats] == [(s["scale"], s["skipped"]) for s in whole[4][30:]]
    assert params_equal(resumed_model.module, whole[0].module)


def test_fabric_clip_gradients_under_16bit_storage_says_what_to_call():
    precision = MixprecFabricPrecision("bf16-true", device="cpu")
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[precision])
    net = make_net()
    model, opt = fabric.setup(net, make_optimizer(net.parameters()))
    x, y = next(iter(batches(*make_data())))
    fabric.backward(F.mse_loss(model(x), y))
    with pytest.raises(ValueError, match=r"precision.clip_grad_norm_\(optimizer, max_norm\)"):
        fabric.clip_gradients(model, opt, max_norm=1.0)


def test_fp16_on_cpu_runs_fp16_with_a_scaler_not_bf16():
    precision = MixprecFabricPrecision("fp16-mixed", device="cpu")
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[precision])
    net = make_net()
    model, opt = fabric.setup(net, make_optimizer(net.parameters()))
    seen = {}
    net[0].register_forward_hook(lambda m, a, out: seen.update(dtype=out.dtype))
    x, y = next(iter(batches(*make_data())))
    fabric.backward(F.mse_loss(model(x), y))
    opt.step()
    assert seen["dtype"] == torch.float16 and float(precision.last_stats.scale) == 2.0**16
    assert precision.precision == "16-mixed"


def test_bad_use_is_refused_with_what_to_do():
    with pytest.raises(ValueError, match="no accumulate="):
        MixprecFabricPrecision("bf16-mixed", device="cpu", accumulate=4)
    with pytest.raises(ValueError, match="Unknown recipe"):
        MixprecFabricPrecision("bf16-mixd", device="cpu")
    precision = MixprecFabricPrecision("bf16-mixed", device="cpu")
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[precision])
    net = make_net()
    model, opt = fabric.setup(net, make_optimizer(net.parameters()))
    with pytest.raises(RuntimeError, match="without a fabric.backward"):
        opt.step()
    lbfgs = torch.optim.LBFGS(net.parameters())
    with pytest.raises(ValueError, match="LBFGS"):
        precision.optimizer_step(lbfgs)
