"""MixprecPrecision, the Lightning plugin: the same numbers as mp.step by hand, skips that hold the
scheduler, bitwise resume through Trainer.fit(ckpt_path=...), and clear refusals."""

from __future__ import annotations

import sys
import warnings

import pytest

L = pytest.importorskip("lightning", reason="the lightning extra is not installed (pip install -e '.[lightning]')")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from integ_helpers import (  # noqa: E402
    BATCH, bitwise, hand_loop, make_data, make_net, make_optimizer, make_scheduler, params_equal,
)
from mixprec.integrations.lightning import MixprecPrecision  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning:lightning.*",
                                        "ignore::FutureWarning")


class Regression(L.LightningModule):
    def __init__(self, manual: bool = False, clip: float | None = None) -> None:
        super().__init__()
        self.net = make_net()
        self.losses: list[torch.Tensor] = []
        self.automatic_optimization = not manual
        self.clip = clip

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.losses.append(loss.detach())
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        self.manual_backward(loss)
        if self.clip is not None:
            self.clip_gradients(opt, gradient_clip_val=self.clip, gradient_clip_algorithm="norm")
        opt.step()
        opt.zero_grad()
        self.lr_schedulers().step()
        return None

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_dtype = self.net[0](x).dtype  # under the recipe's autocast
        return F.mse_loss(self(x), y)

    def configure_optimizers(self):
        opt = make_optimizer(self.parameters())
        return {"optimizer": opt, "lr_scheduler": {"scheduler": make_scheduler(opt), "interval": "step"}}


def fit(plugin, data, *, model=None, epochs=1, ckpt_path=None, **trainer_kwargs):
    kwargs = dict(max_epochs=epochs, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    kwargs.update(trainer_kwargs)
    trainer = L.Trainer(plugins=[plugin], **kwargs)
    model = Regression() if model is None else model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, DataLoader(TensorDataset(*data), batch_size=BATCH), ckpt_path=ckpt_path)
    return trainer, model


@pytest.mark.parametrize("recipe", ["fp32", "bf16-mixed", "fp16-mixed", "bf16-true"])
def test_thirty_steps_equal_mp_step_by_hand_bitwise(recipe):
    data = make_data()
    plugin = MixprecPrecision(recipe)
    trainer, model = fit(plugin, data, gradient_clip_val=0.5)
    ref, ref_steps, ref_sched = hand_loop(recipe, *data, max_grad_norm=0.5)
    assert trainer.global_step == 30 and len(model.losses) == 30
    # the same computation in the same order: bitwise, per step and at the end
    assert bitwise(torch.stack(model.losses), torch.tensor([s["loss"] for s in ref_steps]))
    assert params_equal(model.net, ref)
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == ref_sched.last_epoch == 30
    if recipe == "bf16-true":  # 16-bit storage: Lightning's optimizer steps the fp32 masters
        assert model.net[0].weight.dtype == torch.bfloat16 and model.net[1].weight.dtype == torch.float32
        opt = trainer.optimizers[0]
        assert all(p.dtype == torch.float32 for g in opt.param_groups for p in g["params"])
        assert float(plugin.last_stats.scale) == 1.0
    assert plugin.last_stats.step == 30 and float(plugin.last_stats.grad_norm) == ref_steps[-1]["grad_norm"]


def test_fp16_overflow_skips_the_step_and_holds_the_scheduler(tmp_path):
    data = make_data(overflow_at=(5, 12))
    plugin = MixprecPrecision("fp16-mixed", scaler={"growth_interval": 4})
    logger = L.pytorch.loggers.CSVLogger(tmp_path, name="run", version=0)
    trainer, model = fit(plugin, data, logger=logger, log_every_n_steps=7)
    ref, ref_steps, ref_sched = hand_loop("fp16-mixed", *data, scaler={"growth_interval": 4})
    skipped = [i for i, s in enumerate(ref_steps) if s["skipped"]]
    assert {5, 12} <= set(skipped)  # the injected overflows (and the scaler's own probing above them)
    assert params_equal(model.net, ref)
    sched = trainer.lr_scheduler_configs[0].scheduler
    # 30 optimizer steps attempted (Lightning's global_step), the skipped ones did not advance the schedule
    assert trainer.global_step == 30
    assert sched.last_epoch == ref_sched.last_epoch == 30 - len(skipped) and sched.held == len(skipped)
    assert sched.get_last_lr() == ref_sched.get_last_lr()
    # the records reached the logger, batched (every log_every_n_steps), with the skips and the sawtooth
    import csv
    rows = [r for r in csv.DictReader(open(tmp_path / "run" / "version_0" / "metrics.csv")) if r.get("mixprec/loss_scale")]
    assert [int(r["step"]) for r in rows] == list(range(1, 31))
    assert [float(r["mixprec/skipped"]) for r in rows] == [float(s["skipped"]) for s in ref_steps]
    assert [float(r["mixprec/loss_scale"]) for r in rows] == [s["scale"] for s in ref_steps]
    assert len({float(r["mixprec/loss_scale"]) for r in rows}) > 2  # grown and backed off


@pytest.mark.parametrize("recipe", ["fp16-mixed", "bf16-true-sr"])
def test_resume_through_fit_ckpt_path_continues_bitwise(recipe, tmp_path):
    data = make_data(overflow_at=(3,))
    _, straight = fit(MixprecPrecision(recipe), data, epochs=2)
    first, half = fit(MixprecPrecision(recipe), data, epochs=1)
    ckpt = tmp_path / "epoch1.ckpt"
    first.save_checkpoint(ckpt)
    plugin = MixprecPrecision(recipe)
    resumed_trainer, resumed = fit(plugin, data, epochs=2, ckpt_path=ckpt)
    assert resumed_trainer.global_step == 60
    assert bitwise(torch.stack(resumed.losses), torch.stack(straight.losses[30:]))  # NaN at the overflow
    assert params_equal(resumed.net, straight.net)
    state = torch.load(ckpt, weights_only=False)["MixprecPrecision"]
    assert state["recipe"] == recipe and state["steps"] == 30


def test_accumulate_grad_batches_is_the_window_of_mp_step():
    data = make_data()
    trainer, model = fit(MixprecPrecision("bf16-true-kahan"), data, accumulate_grad_batches=3)
    ref, ref_steps, _ = hand_loop("bf16-true-kahan", *data, accumulate=3)
    assert trainer.global_step == 10 and len(ref_steps) == 10
    assert params_equal(model.net, ref)


def test_manual_optimization_clips_unscaled_gradients():
    data = make_data(overflow_at=(7,))
    plugin = MixprecPrecision("fp16-mixed")
    trainer, model = fit(plugin, data, model=Regression(manual=True, clip=0.5))
    ref, ref_steps, ref_sched = hand_loop("fp16-mixed", *data, max_grad_norm=0.5)
    assert params_equal(model.net, ref)
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == ref_sched.last_epoch == 29


def test_validate_after_fit_runs_the_recipe_on_the_trained_model():
    data = make_data()
    trainer, model = fit(MixprecPrecision("bf16-true"), data, max_steps=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.validate(model, DataLoader(TensorDataset(*data), batch_size=BATCH), verbose=False)
    assert model.val_dtype == torch.bfloat16 and model.net[0].weight.dtype == torch.bfloat16
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_fp16_on_cpu_runs_fp16_with_a_scaler_not_bf16():
    plugin = MixprecPrecision("16-mixed")  # Lightning's name; Lightning itself would run bf16 on a CPU
    trainer = L.Trainer(plugins=[plugin], accelerator="cpu", logger=False)
    assert trainer.precision == "16-mixed" and plugin.mp.recipe.name == "fp16-mixed"
    assert plugin.mp.scaler.is_enabled()
    with plugin.forward_context():
        assert torch.nn.Linear(4, 4)(torch.randn(2, 4)).dtype == torch.float16


# ---------------------------------------------------------------- refusals


def test_lightning_precision_argument_and_the_plugin_exclude_each_other():
    with pytest.raises(ValueError, match="Received both `precision=bf16-mixed`"):
        L.Trainer(precision="bf16-mixed", plugins=[MixprecPrecision("fp16-mixed")], accelerator="cpu", logger=False)


def test_unsupported_strategy_is_refused_with_what_to_do():
    from lightning.pytorch.strategies import SingleDeviceStrategy

    class Custom(SingleDeviceStrategy):  # anything but the tested strategy
        pass

    with pytest.raises(ValueError, match=r"runs on one device \(SingleDeviceStrategy\); this Trainer uses Custom"):
        fit(MixprecPrecision("bf16-mixed"), make_data(), strategy=Custom(device=torch.device("cpu")))


def test_lightning_version_outside_the_tested_range(monkeypatch):
    monkeypatch.setattr(sys.modules["lightning"], "__version__", "2.7.1")
    with pytest.raises(RuntimeError, match=r"lightning 2\.7\.1 is installed; .* tested with lightning>=2\.6,<2\.7"):
        MixprecPrecision("bf16-mixed")
    MixprecPrecision("bf16-mixed", check_version=False)  # the user's choice


def test_bad_options_are_refused_at_construction():
    with pytest.raises(ValueError, match="accumulate_grad_batches=4"):
        MixprecPrecision("bf16-mixed", accumulate=4)
    with pytest.raises(ValueError, match="Unknown recipe 'bf17-mixed'"):
        MixprecPrecision("bf17-mixed")
    with pytest.raises(ValueError, match="scaler arguments"):
        MixprecPrecision("bf16-mixed", scaler={"hysteresis": 2})


def test_value_clipping_with_16bit_storage_is_refused():
    with pytest.raises(ValueError, match="gradient_clip_algorithm='value' is not supported with recipe 'bf16-true'"):
        fit(MixprecPrecision("bf16-true"), make_data(), max_steps=2, gradient_clip_val=0.5,
            gradient_clip_algorithm="value")


def test_two_optimizers_with_16bit_storage_are_refused():
    class Two(Regression):
        def configure_optimizers(self):
            return [make_optimizer(self.net[0].parameters()), make_optimizer(self.net[3].parameters())]

    with pytest.raises(ValueError, match="configure_optimizers returned 2 optimizers"):
        fit(MixprecPrecision("bf16-true"), make_data(), model=Two(manual=True), max_steps=2)


def test_precision_name_seen_by_lightning():
    assert [MixprecPrecision(r).precision for r in ("fp32", "bf16-mixed", "fp16-mixed", "bf16-true", "fp16-true")] == [
        "32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true"]


class ManualEpochInterval(Regression):
    """Manual optimization, the scheduler returned as Lightning's docs show ([opt], [sched]: interval
    "epoch"), stepped by the user after every optimizer step, or at the epoch's end."""

    def __init__(self, per_step: bool) -> None:
        super().__init__(manual=True)
        self.per_step = per_step

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt = self.optimizers()
        self.manual_backward(F.mse_loss(self(x), y))
        opt.step()
        opt.zero_grad()
        if self.per_step:
            self.lr_schedulers().step()

    def on_train_epoch_end(self):
        if not self.per_step:
            self.lr_schedulers().step()

    def configure_optimizers(self):
        opt = make_optimizer(self.parameters())
        return [opt], [make_scheduler(opt)]


def test_manual_optimization_says_when_an_unheld_scheduler_advances_after_a_skipped_step():
    data = make_data(overflow_at=(5,))
    plugin = MixprecPrecision("fp16-mixed")
    trainer = L.Trainer(plugins=[plugin], max_epochs=1, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.warns(RuntimeWarning, match=r"manual optimization a StepLR was stepped right after an optimizer step "
                                            r"the loss scaler skipped .* \"interval\": \"step\""):
        trainer.fit(ManualEpochInterval(per_step=True), DataLoader(TensorDataset(*data), batch_size=BATCH))
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 30  # stepped as the user asked, and said
    # an epoch schedule stepped at the epoch's end is as intended: nothing said
    plugin = MixprecPrecision("fp16-mixed")
    trainer = L.Trainer(plugins=[plugin], max_epochs=1, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(ManualEpochInterval(per_step=False), DataLoader(TensorDataset(*data), batch_size=BATCH))
    assert not [w for w in caught if "loss scaler skipped" in str(w.message)]
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 1


def test_manual_optimization_resume_keeps_the_scaler_and_the_schedule_position(tmp_path):
    data = make_data(overflow_at=(5, 12))
    _, straight = fit(MixprecPrecision("fp16-mixed"), data, model=Regression(manual=True), epochs=2)
    first, _ = fit(MixprecPrecision("fp16-mixed"), data, model=Regression(manual=True), epochs=1)
    first_sched = first.lr_scheduler_configs[0].scheduler
    ckpt = tmp_path / "manual.ckpt"
    first.save_checkpoint(ckpt)
    plugin = MixprecPrecision("fp16-mixed")
    resumed_trainer, resumed = fit(plugin, data, model=Regression(manual=True), epochs=2, ckpt_path=ckpt)
    assert bitwise(torch.stack(resumed.losses), torch.stack(straight.losses[30:]))  # the scale was applied, skips too
    assert params_equal(resumed.net, straight.net)
    assert float(plugin.last_stats.scale) == float(plugin.mp.scaler.get_scale())
    sched = resumed_trainer.lr_scheduler_configs[0].scheduler
    # the position is the checkpoint's (held steps of both runs left out); `held` counts this fit's only
    assert sched.last_epoch == 60 - first_sched.held - sched.held and first_sched.held >= 2 and sched.held >= 2
