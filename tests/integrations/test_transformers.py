"""MixprecTrainer, the Hugging Face Trainer with a mixprec recipe: a tiny GPT-2 built from a config
trained 20 steps equals a hand-written mixprec loop; the scale and the skips are in the Trainer's
logs; skipped steps hold the scheduler; resume is bitwise; refusals are clear."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers", reason="the transformers extra is not installed "
                                   "(pip install -e '.[transformers]')")
pytest.importorskip("accelerate")

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, get_scheduler  # noqa: E402

from integ_helpers import params_equal  # noqa: E402
from mixprec import MixedPrecision  # noqa: E402
from mixprec.integrations.transformers import MixprecTrainer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

STEPS, BATCH, SEQ, VOCAB = 20, 4, 16, 64
SCALER = {"init_scale": 2.0**24, "growth_interval": 5}  # starts too high: the first steps overflow fp16


def tiny_gpt2() -> torch.nn.Module:
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = STEPS * BATCH) -> None:
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def training_args(out, **kw) -> TrainingArguments:
    base = dict(output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=BATCH, learning_rate=1e-3,
                logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
                train_sampling_strategy="sequential", lr_scheduler_type="linear", max_grad_norm=1.0,
                log_level="error")
    base.update(kw)
    return TrainingArguments(**base)


def hand_loop(recipe: str, scaler=None):
    """mixprec by hand over the Trainer's choices: its AdamW (fused, decay groups), linear
    schedule, clip at 1.0, the same batches in order, the loss normalised by the tokens counted."""
    mp = MixedPrecision(recipe, "cpu", **({"scaler": scaler} if scaler else {}))
    model = mp.prepare(tiny_gpt2())
    decay = set(Trainer.get_decay_parameter_names(None, model))
    named = mp.named_parameters(model)
    groups = [{"params": [p for n, p in named if n in decay], "weight_decay": 0.0},
              {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, fused=True)
    sched = get_scheduler("linear", opt, num_warmup_steps=0, num_training_steps=STEPS)
    ids = Tokens().ids
    steps, lrs = [], []
    for i in range(STEPS):
        x = ids[i * BATCH:(i + 1) * BATCH]
        with mp.autocast():
            # the Trainer's convention for this model: the loss summed over the (shifted) targets and
            # divided by every label it counts (it does not shift GPT-2's labels when counting)
            loss = model(input_ids=x, labels=x, num_items_in_batch=x.ne(-100).sum()).loss
        lrs.append(sched.get_last_lr()[0])
        steps.append(mp.step(loss, opt, max_grad_norm=1.0, scheduler=sched).to_dict())
    return model, steps, lrs, sched


def train_logs(trainer) -> list[dict]:
    return [h for h in trainer.state.log_history if "loss" in h and "step" in h]


@pytest.mark.parametrize("recipe", ["bf16-mixed", "fp16-mixed"])
def test_twenty_steps_match_a_hand_written_loop_with_scale_and_skips_in_the_logs(recipe, tmp_path):
    scaler = SCALER if recipe == "fp16-mixed" else None
    trainer = MixprecTrainer(model=tiny_gpt2(), args=training_args(tmp_path), train_dataset=Tokens(),
                             mixprec=recipe, mixprec_options={"scaler": scaler} if scaler else None)
    trainer.train()
    ref, steps, lrs, ref_sched = hand_loop(recipe, scaler)
    logs = train_logs(trainer)
    assert [h["step"] for h in logs] == list(range(1, STEPS + 1))
    assert [h["loss"] for h in logs] == [s["loss"] for s in steps]  # the Trainer's own loss: unscaled
    assert [h["mixprec/loss_scale"] for h in logs] == [s["scale"] for s in steps]
    assert [h["mixprec/skipped_steps"] for h in logs] == [float(s["skipped"]) for s in steps]
    # mixprec's norm before clipping, unscaled (inf/NaN at the skipped steps)
    assert [repr(h["grad_norm"]) for h in logs] == [repr(s["grad_norm"]) for s in steps]
    assert [h["learning_rate"] for h in logs] == lrs
    assert params_equal(trainer.model, ref)
    skips = sum(s["skipped"] for s in steps)
    assert trainer.lr_scheduler.last_epoch == ref_sched.last_epoch == STEPS - skips
    if recipe == "fp16-mixed":
        assert 2 <= skips <= 10 and trainer.lr_scheduler.held == skips  # skipped steps did not advance it
    else:
        assert skips == 0 and all(h["mixprec/loss_scale"] == 1.0 for h in logs)


def test_bf16_true_masters_under_the_trainers_optimizer(tmp_path):
    trainer = MixprecTrainer(model=tiny_gpt2(), args=training_args(tmp_path, max_steps=6), train_dataset=Tokens(),
                             mixprec="bf16-true")
    trainer.train()
    inner = trainer.optimizer.optimizer.optimizer  # Accelerate's wrapper -> mixprec's step -> AdamW
    assert all(p.dtype == torch.float32 for g in inner.param_groups for p in g["params"])
    assert trainer.model.transformer.h[0].mlp.c_fc.weight.dtype == torch.bfloat16
    assert trainer.model.transformer.h[0].ln_1.weight.dtype == torch.float32
    assert trainer.last_stats.step == 6


def test_resume_from_a_checkpoint_continues_bitwise(tmp_path):
    kw = dict(mixprec="fp16-mixed", mixprec_options={"scaler": SCALER})
    straight = MixprecTrainer(model=tiny_gpt2(), args=training_args(tmp_path / "a"), train_dataset=Tokens(), **kw)
    straight.train()
    first = MixprecTrainer(model=tiny_gpt2(), args=training_args(tmp_path / "b", save_strategy="steps", save_steps=10),
                           train_dataset=Tokens(), **kw)
    first.train()
    ckpt = tmp_path / "b" / "checkpoint-10"
    assert (ckpt / "mixprec.pt").is_file()
    resumed = MixprecTrainer(model=tiny_gpt2(), args=training_args(tmp_path / "b"), train_dataset=Tokens(), **kw)
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert params_equal(resumed.model, straight.model)
    # the resumed history is the checkpoint's 10 steps and the 10 run after it
    keys = ("step", "loss", "mixprec/loss_scale", "mixprec/skipped_steps", "learning_rate")
    assert [[h[k] for k in keys] for h in train_logs(resumed)] == [[h[k] for k in keys] for h in train_logs(straight)]
    assert resumed.mp.scaler.get_scale() == straight.mp.scaler.get_scale()


class _SeenArgs(transformers.TrainerCallback):
    """What a logger integration reads: the arguments handed to every callback."""

    def __init__(self) -> None:
        self.max_grad_norms: list[float] = []

    def on_log(self, args, state, control, **kwargs):
        self.max_grad_norms.append(args.max_grad_norm)


@pytest.mark.parametrize("clip", [1.0, 0.0])
def test_the_max_grad_norm_recorded_is_the_one_applied(tmp_path, clip):
    # issue 29.6: training_args.bin and the loggers said max_grad_norm=0.0 while mixprec clipped at 1.0
    seen = _SeenArgs()
    args = training_args(tmp_path, max_steps=3, save_strategy="steps", save_steps=3, max_grad_norm=clip)
    trainer = MixprecTrainer(model=tiny_gpt2(), args=args, train_dataset=Tokens(), mixprec="bf16-true",
                             callbacks=[seen])
    trainer.train()
    assert trainer.args.max_grad_norm == clip and args.max_grad_norm == clip
    saved = torch.load(tmp_path / "checkpoint-3" / "training_args.bin", weights_only=False)
    assert saved.max_grad_norm == clip
    assert seen.max_grad_norms and set(seen.max_grad_norms) == {clip}
    assert trainer.last_stats.grad_norm is not None  # mixprec measured (and, with clip > 0, clipped) it


# ---------------------------------------------------------------- refusals


def test_trainers_own_fp16_is_refused_not_silently_fp32(tmp_path):
    with pytest.raises(ValueError, match=r"TrainingArguments\(fp16=True\) .* silently trains in fp32"):
        MixprecTrainer(model=tiny_gpt2(), args=TrainingArguments(output_dir=str(tmp_path), fp16=True, use_cpu=True),
                       mixprec="fp16-mixed")


def test_framework_versions_outside_the_tested_range(monkeypatch, tmp_path):
    import sys

    # (transformers is a lazy module: the object in sys.modules is the one that answers)
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "6.0.0")
    with pytest.raises(RuntimeError, match=r"transformers 6\.0\.0 is installed; .* tested with transformers>=5\.24,<6"):
        MixprecTrainer(model=tiny_gpt2(), args=training_args(tmp_path), mixprec="bf16-mixed")
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.24.0")
    monkeypatch.setattr(sys.modules["accelerate"], "__version__", "0.34.2")
    with pytest.raises(RuntimeError, match=r"accelerate 0\.34\.2 is installed"):
        MixprecTrainer(model=tiny_gpt2(), args=training_args(tmp_path), mixprec="bf16-mixed")
    MixprecTrainer(model=tiny_gpt2(), args=training_args(tmp_path), mixprec="bf16-mixed", check_version=False)


def test_resuming_from_a_plain_trainer_checkpoint_is_refused(tmp_path):
    plain = Trainer(model=tiny_gpt2(), args=training_args(tmp_path, max_steps=2, save_strategy="steps", save_steps=2),
                    train_dataset=Tokens())
    plain.train()
    trainer = MixprecTrainer(model=tiny_gpt2(), args=training_args(tmp_path, max_steps=4), train_dataset=Tokens(),
                             mixprec="fp16-mixed")
    with pytest.raises(FileNotFoundError, match="has no mixprec.pt"):
        trainer.train(resume_from_checkpoint=True)
