"""The recipes the framework tests did not run, through Fabric, Lightning and the Hugging Face Trainer:
fp8 (its layers swapped, delayed scaling's amax history advancing), the compact masters
(bf16-true-kahan/-sr/-remainder), fp16-pure, and the Trainer's gradient accumulation with fp16. Each is
compared with the same recipe through ``mp.step`` by hand, bit for bit (the same ops run), the mixprec
state (scaler, masters, fp8 history, step count) included; resumes continue as the uninterrupted run.

Found by the probe: ``MixprecTrainer`` took ``accumulate=`` (in ``mixprec_options`` or a ``MixedPrecision``)
and ignored it, stepping after every batch; ``fabric.save`` of the plugin inside an accumulation window
saved without the window's gradients, so the resumed run started the window over and diverged."""

from __future__ import annotations

import os
import warnings

import pytest

L = pytest.importorskip("lightning", reason="the lightning extra is not installed (pip install -e '.[lightning]')")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from mixprec import MixedPrecision  # noqa: E402
from mixprec.integrations.fabric import MixprecFabricPrecision  # noqa: E402
from mixprec.integrations.lightning import MixprecPrecision  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning",
                                        "ignore::FutureWarning")

B, STEPS = 8, 9


def make_net() -> nn.Module:
    """Four linears of multiples of 16: the middle two compute in fp8 (the first and last stay bf16)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(),
                         nn.Linear(32, 16))


def make_data(overflow_at: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(STEPS * B, 16, generator=g), torch.randn(STEPS * B, 16, generator=g)
    for b in overflow_at:  # inputs that overflow fp16
        x[b * B:(b + 1) * B] *= 1e5
    return x, y


def same(a, b) -> bool:
    """The same bits (NaN included), through dicts and lists; keys without a LightningModule's ``net.``."""
    if isinstance(a, dict):
        a, b = ({k[4:] if isinstance(k, str) and k.startswith("net.") else k: v for k, v in d.items()} for d in (a, b))
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return (a.shape == b.shape and a.dtype == b.dtype
                and torch.equal(a.detach().contiguous().view(torch.uint8), b.detach().contiguous().view(torch.uint8)))
    return a == b


def hand_loop(recipe, x, y, *, accumulate=1, clip=None, epochs=1):
    mp = MixedPrecision(recipe, "cpu", accumulate=accumulate)
    model = mp.prepare(make_net())
    opt = torch.optim.AdamW(mp.parameters(model), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.9)
    for _ in range(epochs):
        for i in range(0, len(x), B):
            with mp.autocast():
                loss = F.mse_loss(model(x[i:i + B]), y[i:i + B])
            mp.step(loss, opt, max_grad_norm=clip, scheduler=sched)
    return model, mp, sched


def fp8_history_advanced(mp) -> bool:
    return bool(mp.fp8.layers) and all(float(m.fp8_amax_history.abs().sum()) > 0 for _, m in mp.fp8.layers)


# ---------------------------------------------------------------- Fabric


def fabric_loop(recipe, x, y, *, accumulate=1, clip=None, save=None, load=None, batches=None):
    precision = MixprecFabricPrecision(recipe, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[precision])
        net = make_net()
        model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    precision.connect(opt)
    sched = precision.skip_aware(torch.optim.lr_scheduler.StepLR(opt.optimizer, 1, 0.9))  # as hand_loop's
    state = {"model": model, "optimizer": opt, "mixprec": precision, "scheduler": sched}
    if load is not None:
        fabric.load(load, state)
    for i in batches if batches is not None else range(len(x) // B):
        fabric.backward(F.mse_loss(model(x[i * B:(i + 1) * B]), y[i * B:(i + 1) * B]) / accumulate)
        if (i + 1) % accumulate:
            continue
        if clip is not None:
            if precision.mp.masters is not None:
                precision.clip_grad_norm_(opt, clip)
            else:
                fabric.clip_gradients(model, opt, max_norm=clip)
        opt.step()
        opt.zero_grad()
        sched.step()
    if save is not None:
        fabric.save(save, state)
    return net, precision.mp, fabric, state


@pytest.mark.parametrize("recipe", ["fp8-delayed", "fp8-current", "bf16-true-remainder", "bf16-true-sr", "fp16-pure"])
@pytest.mark.parametrize("accumulate", [1, 3])
def test_fabric_runs_the_recipe_as_mp_step_does(recipe, accumulate):
    x, y = make_data()
    net, mp, _, _ = fabric_loop(recipe, x, y, accumulate=accumulate, clip=1.0)
    ref, ref_mp, _ = hand_loop(recipe, x, y, accumulate=accumulate, clip=1.0)
    assert same(net.state_dict(), ref.state_dict()) and same(mp.state_dict(), ref_mp.state_dict())
    assert mp.state_dict()["steps"] == STEPS // accumulate
    if recipe.startswith("fp8"):  # fp8, not bf16 under its name: swapped by fabric.setup, history advancing
        assert [type(m).__name__ for m in net if isinstance(m, nn.Linear)] == ["Linear", "Fp8Linear", "Fp8Linear",
                                                                              "Linear"]
        assert recipe == "fp8-current" or fp8_history_advanced(mp)
    else:
        assert net[0].weight.dtype == mp.recipe.policy.param_dtype != torch.float32


@pytest.mark.parametrize("recipe", ["fp8-delayed", "bf16-true-remainder", "bf16-true-kahan"])
def test_fabric_resume_keeps_fp8_history_and_compact_masters(recipe, tmp_path):
    x, y = make_data()
    whole, whole_mp, _, _ = fabric_loop(recipe, x, y)
    fabric_loop(recipe, x, y, batches=range(4), save=tmp_path / "ckpt")
    resumed, resumed_mp, _, _ = fabric_loop(recipe, x, y, batches=range(4, STEPS), load=tmp_path / "ckpt")
    assert same(resumed.state_dict(), whole.state_dict())
    assert same(resumed_mp.state_dict(), whole_mp.state_dict())  # fp8 history, remainders/compensation, steps


@pytest.mark.parametrize("recipe", ["fp16-mixed", "bf16-true-kahan"])
def test_fabric_save_inside_an_accumulation_window_is_refused(recipe, tmp_path):
    # it saved without the window's gradients: the resumed run started the window over, without a word
    x, y = make_data()
    _, mp, fabric, state = fabric_loop(recipe, x, y, accumulate=2, batches=range(3))  # a step, then one backward
    with pytest.raises(RuntimeError, match=r"fabric.save inside an accumulation window \(1 fabric.backward .*"
                                           r"Save after optimizer.step\(\)"):
        fabric.save(tmp_path / "mid", state)
    assert not os.path.exists(tmp_path / "mid")
    model, opt = state["model"], state["optimizer"]
    fabric.backward(F.mse_loss(model(x[3 * B:4 * B]), y[3 * B:4 * B]) / 2)
    opt.step()
    fabric.save(tmp_path / "after", state)  # after the step it saves
    assert torch.load(tmp_path / "after", weights_only=False)["mixprec"]["steps"] == mp.state_dict()["steps"] == 2


# ---------------------------------------------------------------- Lightning


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self(batch[0]), batch[1])

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.9),
                                                   "interval": "step"}}


def lightning_fit(recipe, x, y, *, epochs=1, ckpt_path=None, save=None, **kw):
    plugin = MixprecPrecision(recipe)
    trainer = L.Trainer(plugins=[plugin], max_epochs=epochs, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, **kw)
    model = Regression()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=B), ckpt_path=ckpt_path)
    if save is not None:
        trainer.save_checkpoint(save)
    return trainer, model, plugin.mp


@pytest.mark.parametrize("recipe", ["fp8-delayed", "bf16-true-remainder", "bf16-true-sr", "fp16-pure", "fp16-mixed"])
def test_lightning_accumulate_and_clip_equal_mp_step(recipe):
    x, y = make_data(overflow_at=(4,) if recipe == "fp16-mixed" else ())
    trainer, model, mp = lightning_fit(recipe, x, y, accumulate_grad_batches=3, gradient_clip_val=0.5)
    ref, ref_mp, ref_sched = hand_loop(recipe, x, y, accumulate=3, clip=0.5)
    assert same(model.net.state_dict(), ref.state_dict()) and same(mp.state_dict(), ref_mp.state_dict())
    assert trainer.global_step == STEPS // 3
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == ref_sched.last_epoch
    if recipe == "fp16-mixed":  # the overflow in the window's middle skipped its step and held the schedule
        assert ref_sched.last_epoch == STEPS // 3 - 1 and mp.scaler.get_scale() < 2.0**16
    if recipe == "fp8-delayed":
        assert [type(m).__name__ for m in model.net][2::2] == ["Fp8Linear", "Fp8Linear", "Linear"]
        assert fp8_history_advanced(mp)


@pytest.mark.parametrize("recipe", ["fp8-delayed", "bf16-true-kahan", "bf16-true-remainder"])
def test_lightning_resume_keeps_fp8_history_and_compact_masters(recipe, tmp_path):
    x, y = make_data()
    _, whole, whole_mp = lightning_fit(recipe, x, y, epochs=2)
    lightning_fit(recipe, x, y, epochs=1, save=tmp_path / "e1.ckpt")
    saved = torch.load(tmp_path / "e1.ckpt", weights_only=False)["MixprecPrecision"]
    assert set(saved) >= {"scaler", "steps", "fp8" if recipe.startswith("fp8") else "masters"}
    trainer, resumed, resumed_mp = lightning_fit(recipe, x, y, epochs=2, ckpt_path=tmp_path / "e1.ckpt")
    assert trainer.global_step == 2 * STEPS
    assert same(resumed.state_dict(), whole.state_dict()) and same(resumed_mp.state_dict(), whole_mp.state_dict())


# ---------------------------------------------------------------- Hugging Face Trainer


def _hf():
    pytest.importorskip("transformers", reason="the transformers extra is not installed")
    pytest.importorskip("accelerate")
    import test_transformers as tt

    return tt


def hf_hand_loop(tt, recipe, scaler, gas, steps):
    """mp.step over the Trainer's choices, its window: the loss of each micro-batch normalised by the
    tokens of the whole window (the Trainer's num_items_in_batch), times gas (which mp.step divides out)."""
    from transformers import Trainer, get_scheduler

    mp = MixedPrecision(recipe, "cpu", accumulate=gas, **({"scaler": scaler} if scaler else {}))
    model = mp.prepare(tt.tiny_gpt2())
    decay = set(Trainer.get_decay_parameter_names(None, model))
    named = mp.named_parameters(model)
    groups = [{"params": [p for n, p in named if n in decay], "weight_decay": 0.0},
              {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, fused=True)
    sched = get_scheduler("linear", opt, num_warmup_steps=0, num_training_steps=steps)
    ids = tt.Tokens(steps * gas * tt.BATCH).ids
    out, lrs = [], []
    for i in range(steps * gas):
        x = ids[i * tt.BATCH:(i + 1) * tt.BATCH]
        window = ids[(i // gas) * gas * tt.BATCH:((i // gas) + 1) * gas * tt.BATCH]
        with mp.autocast():
            loss = model(input_ids=x, labels=x, num_items_in_batch=window.ne(-100).sum()).loss * gas
        if i % gas == 0:
            lrs.append(sched.get_last_lr()[0])
        stats = mp.step(loss, opt, max_grad_norm=1.0, scheduler=sched)
        if stats.stepped:
            out.append(stats.to_dict())
    return model, out, lrs, sched


def test_trainer_gradient_accumulation_with_fp16_equals_mp_step(tmp_path):
    tt = _hf()
    from mixprec.integrations.transformers import MixprecTrainer

    gas, steps = 2, 8
    trainer = MixprecTrainer(model=tt.tiny_gpt2(), args=tt.training_args(tmp_path, max_steps=steps,
                                                                         gradient_accumulation_steps=gas),
                             train_dataset=tt.Tokens(steps * gas * tt.BATCH), mixprec="fp16-mixed",
                             mixprec_options={"scaler": tt.SCALER})
    trainer.train()
    ref, ref_steps, lrs, ref_sched = hf_hand_loop(tt, "fp16-mixed", tt.SCALER, gas, steps)
    logs = tt.train_logs(trainer)
    skips = sum(s["skipped"] for s in ref_steps)
    assert 1 <= skips < steps and len(logs) == steps
    assert [h["loss"] for h in logs] == [s["loss"] for s in ref_steps]  # the window's loss, unscaled
    assert [h["mixprec/skipped_steps"] for h in logs] == [float(s["skipped"]) for s in ref_steps]
    assert [h["mixprec/loss_scale"] for h in logs] == [s["scale"] for s in ref_steps]
    assert [repr(h["grad_norm"]) for h in logs] == [repr(s["grad_norm"]) for s in ref_steps]
    assert [h["learning_rate"] for h in logs] == lrs  # a skipped step did not advance the schedule
    assert trainer.lr_scheduler.last_epoch == ref_sched.last_epoch == steps - skips == steps - trainer.lr_scheduler.held
    assert tt.params_equal(trainer.model, ref)


def test_trainer_resume_with_accumulation_and_save_total_limit_keeps_fp8_history(tmp_path):
    tt = _hf()
    import transformers

    from mixprec.integrations.transformers import MixprecTrainer

    class StopAt4(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == 4

    def trainer(out, **kw):
        args = tt.training_args(out, max_steps=8, gradient_accumulation_steps=2, save_total_limit=1, **kw)
        return MixprecTrainer(model=tt.tiny_gpt2(), args=args, train_dataset=tt.Tokens(), mixprec="fp8-delayed")

    straight = trainer(tmp_path / "a")
    straight.train()
    first = trainer(tmp_path / "b", save_strategy="steps", save_steps=2)
    first.add_callback(StopAt4())
    first.train()
    assert sorted(os.listdir(tmp_path / "b")) == ["checkpoint-4"]
    resumed = trainer(tmp_path / "b", save_strategy="steps", save_steps=2)
    resumed.train(resume_from_checkpoint=True)
    assert fp8_history_advanced(resumed.mp) and resumed.mp.fp8.layers
    assert tt.params_equal(resumed.model, straight.model)
    assert same(resumed.mp.state_dict(), straight.mp.state_dict())
    keys = ("step", "loss", "learning_rate")
    logs = [[[h[k] for k in keys] for h in tt.train_logs(t)] for t in (resumed, straight)]
    assert logs[0] == logs[1] and len(logs[0]) == 8


@pytest.mark.parametrize("how", ["options", "object"])
def test_trainer_refuses_mixprecs_accumulate(how, tmp_path):
    # it was taken and ignored: the Trainer stepped after every batch, mp.accumulate said 4
    tt = _hf()
    from mixprec.integrations.transformers import MixprecTrainer

    kw = ({"mixprec": "bf16-mixed", "mixprec_options": {"accumulate": 4}} if how == "options"
          else {"mixprec": MixedPrecision("bf16-mixed", "cpu", accumulate=4)})
    with pytest.raises(ValueError, match=r"MixprecTrainer takes no accumulate= \(got accumulate=4\).* "
                                         r"TrainingArguments\(gradient_accumulation_steps=4\)"):
        MixprecTrainer(model=tt.tiny_gpt2(), args=tt.training_args(tmp_path, max_steps=4), train_dataset=tt.Tokens(),
                       **kw)
    trainer = MixprecTrainer(model=tt.tiny_gpt2(), args=tt.training_args(tmp_path, max_steps=2,
                                                                         gradient_accumulation_steps=4),
                             train_dataset=tt.Tokens(), mixprec="bf16-mixed")
    trainer.train()
    assert trainer.last_stats.step == 2 and trainer.state.global_step == 2
