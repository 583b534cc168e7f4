"""Found by probing the integrations as users run them: resuming from a checkpoint of another recipe
or of a run without mixprec says what to do (Lightning resumed it silently, the scaler and the step
count restarting); a validation from such a checkpoint runs; MixprecTrainer's mixprec.pt is written
before the Trainer deletes older checkpoints, so a save that dies midway leaves a resumable one."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning",
                                        "ignore::FutureWarning")


# ---------------------------------------------------------------- Lightning


def _lightning():
    L = pytest.importorskip("lightning", reason="the lightning extra is not installed")
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from integ_helpers import make_data, make_net, make_optimizer, make_scheduler

    class Regression(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_net()

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            return F.mse_loss(self(batch[0]), batch[1])

        def validation_step(self, batch, batch_idx):
            loss = F.mse_loss(self(batch[0]), batch[1])
            self.log("val_loss", loss)
            return loss

        def configure_optimizers(self):
            opt = make_optimizer(self.parameters())
            return {"optimizer": opt, "lr_scheduler": {"scheduler": make_scheduler(opt), "interval": "step"}}

    x, y = make_data()
    data = DataLoader(TensorDataset(x, y), batch_size=8)

    def trainer(plugin=None, **kw):
        base = dict(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
        base.update(kw)
        return L.Trainer(plugins=[plugin] if plugin is not None else None, **base)

    return Regression, data, trainer


def _saved(tmp_path, name, plugin, Regression, data, trainer):
    t = trainer(plugin, max_steps=5)
    t.fit(Regression(), data)
    path = tmp_path / f"{name}.ckpt"
    t.save_checkpoint(path)
    return path


def test_lightning_resume_from_a_checkpoint_without_mixprec_state_is_refused(tmp_path):
    Regression, data, trainer = _lightning()  # (first: it skips without the lightning extra)
    from mixprec.integrations.lightning import MixprecPrecision

    plain = _saved(tmp_path, "plain", None, Regression, data, trainer)
    plugin = MixprecPrecision("fp16-mixed")
    with pytest.raises(ValueError, match=r"holds no MixprecPrecision state: .* the loss scaler and the step count "
                                         r"cannot be restored\. .* Trainer\.fit without ckpt_path"):
        trainer(plugin, max_steps=10).fit(Regression(), data, ckpt_path=plain)
    assert plugin.mp.state_dict()["steps"] == 0  # nothing ran


def test_lightning_resume_with_another_recipe_names_the_checkpoints_recipe(tmp_path):
    Regression, data, trainer = _lightning()  # (first: it skips without the lightning extra)
    from mixprec.integrations.lightning import MixprecPrecision

    ckpt = _saved(tmp_path, "bf16", MixprecPrecision("bf16-true"), Regression, data, trainer)
    with pytest.raises(ValueError, match=r"resumes a run of recipe 'bf16-true' with MixprecPrecision\('fp16-mixed'\)"
                                         r".* Resume with MixprecPrecision\('bf16-true'\)"):
        trainer(MixprecPrecision("fp16-mixed"), max_steps=10).fit(Regression(), data, ckpt_path=ckpt)
    # the same recipe resumes
    plugin = MixprecPrecision("bf16-true")
    resumed = trainer(plugin, max_steps=10, max_epochs=2)
    resumed.fit(Regression(), data, ckpt_path=ckpt)
    assert resumed.global_step == plugin.mp.state_dict()["steps"] == 10


@pytest.mark.parametrize("saved_with", [None, "bf16-true"])
def test_lightning_validate_from_any_checkpoint_runs_the_plugins_recipe(saved_with, tmp_path):
    Regression, data, trainer = _lightning()  # (first: it skips without the lightning extra)
    from mixprec.integrations.lightning import MixprecPrecision

    ckpt = _saved(tmp_path, "run", MixprecPrecision(saved_with) if saved_with else None, Regression, data, trainer)
    plugin = MixprecPrecision("fp16-mixed")
    model = Regression()
    out = trainer(plugin).validate(model, data, ckpt_path=ckpt, verbose=False)
    assert out and "val_loss" in out[0]
    saved = torch.load(ckpt, weights_only=False)["state_dict"]
    assert torch.equal(model.net[0].weight, saved["net.0.weight"].float())  # the checkpoint's weights
    assert plugin.mp.scaler.get_scale() == MixprecPrecision("fp16-mixed").mp.scaler.get_scale()


# ---------------------------------------------------------------- Hugging Face Trainer


def _hf():
    pytest.importorskip("transformers", reason="the transformers extra is not installed")
    pytest.importorskip("accelerate")
    import test_transformers as tt

    return tt


def test_trainer_resume_with_another_recipe_names_the_checkpoints_recipe(tmp_path):
    tt = _hf()
    from mixprec.integrations.transformers import MixprecTrainer

    args = tt.training_args(tmp_path, max_steps=2, save_strategy="steps", save_steps=2)
    MixprecTrainer(model=tt.tiny_gpt2(), args=args, train_dataset=tt.Tokens(), mixprec="bf16-true").train()
    trainer = MixprecTrainer(model=tt.tiny_gpt2(), args=tt.training_args(tmp_path, max_steps=4),
                             train_dataset=tt.Tokens(), mixprec="fp16-mixed")
    with pytest.raises(ValueError, match=r"checkpoint-2 was saved by a run of recipe 'bf16-true'; this MixprecTrainer "
                                         r"runs 'fp16-mixed'\. Resume with mixprec='bf16-true'") as refused:
        trainer.train(resume_from_checkpoint=True)
    assert "strict=False" not in str(refused.value)  # (the Trainer has no such option to pass)


def test_trainer_save_that_dies_writing_mixprec_pt_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    tt = _hf()
    import mixprec.integrations.transformers as mt

    real, calls = mt.save_atomically, []

    def dies_the_second_time(obj, path):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real(obj, path)

    monkeypatch.setattr(mt, "save_atomically", dies_the_second_time)
    args = tt.training_args(tmp_path, max_steps=4, save_strategy="steps", save_steps=2, save_total_limit=1)
    trainer = mt.MixprecTrainer(model=tt.tiny_gpt2(), args=args, train_dataset=tt.Tokens(), mixprec="fp16-mixed",
                                mixprec_options={"scaler": tt.SCALER})
    with pytest.raises(OSError, match="No space left"):
        trainer.train()
    # the Trainer deletes older checkpoints after it wrote a new one: mixprec.pt is part of the new one by then
    assert os.path.isfile(tmp_path / "checkpoint-2" / "mixprec.pt")
    monkeypatch.setattr(mt, "save_atomically", real)
    resumed = mt.MixprecTrainer(model=tt.tiny_gpt2(), args=tt.training_args(tmp_path, max_steps=4),
                                train_dataset=tt.Tokens(), mixprec="fp16-mixed", mixprec_options={"scaler": tt.SCALER})
    with pytest.raises(FileNotFoundError, match=r"checkpoint-4, which has no mixprec\.pt: .* \(or its save was interrupted\).*/checkpoint-2 has one\)"):
        resumed.train(resume_from_checkpoint=True)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert resumed.last_stats.step == 4


def test_trainer_every_checkpoint_has_its_mixprec_pt_once(tmp_path):
    tt = _hf()
    from mixprec.integrations.transformers import MixprecTrainer

    args = tt.training_args(tmp_path, max_steps=4, save_strategy="steps", save_steps=2, save_total_limit=1)
    MixprecTrainer(model=tt.tiny_gpt2(), args=args, train_dataset=tt.Tokens(), mixprec="bf16-true").train()
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-4"]
    state = torch.load(tmp_path / "checkpoint-4" / "mixprec.pt", weights_only=True)
    assert state["recipe"] == "bf16-true" and state["steps"] == 4
    assert not [n for n in os.listdir(tmp_path / "checkpoint-4") if n.startswith(".mixprec.pt")]


# ---------------------------------------------------------------- Fabric


def test_fabric_load_of_another_recipes_state_names_it(tmp_path):
    L = pytest.importorskip("lightning", reason="the lightning extra is not installed")
    import torch.nn.functional as F

    from integ_helpers import make_net
    from mixprec.integrations.fabric import MixprecFabricPrecision

    def run(recipe, *, save=None, load=None, strict=True):
        precision = MixprecFabricPrecision(recipe, device="cpu")
        fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[precision])
        net = make_net()
        model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
        precision.connect(opt)
        if load is not None:
            fabric.load(load, {"model": model, "optimizer": opt, "mixprec": precision} if strict else {"model": model},
                        strict=strict)
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))
        for _ in range(2):
            fabric.backward(F.mse_loss(model(x), x[:, :4]))
            opt.step()
            opt.zero_grad()
        if save is not None:
            fabric.save(save, {"model": model, "optimizer": opt, "mixprec": precision})
        return precision

    run("bf16-true", save=tmp_path / "a.ckpt")
    with pytest.raises(ValueError, match=r"a run of recipe 'bf16-true', and this plugin runs 'fp16-mixed'.* "
                                         r"MixprecFabricPrecision\('bf16-true'\), or .* strict=False"):
        run("fp16-mixed", load=tmp_path / "a.ckpt")
    assert run("fp16-mixed", load=tmp_path / "a.ckpt", strict=False).mp.state_dict()["steps"] == 2  # what it says works
    assert run("bf16-true", load=tmp_path / "a.ckpt").mp.state_dict()["steps"] == 4
