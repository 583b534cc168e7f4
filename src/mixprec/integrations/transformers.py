"""The Hugging Face Trainer running a mixprec recipe: change ``Trainer(`` to ``MixprecTrainer(``.

    from mixprec.integrations.transformers import MixprecTrainer

    trainer = MixprecTrainer(model=model, args=args, train_dataset=ds, mixprec="fp16-mixed",
                             mixprec_options={"scaler": {"hysteresis": 2}})
    trainer.train()

The Trainer keeps its loop, its data, its optimizer and scheduler choices, its callbacks and its
checkpoints; mixprec takes the parts of the step that are precision, through the Trainer's public
methods (``MixprecTrainerMixin`` holds them, for your own ``Trainer`` subclass:
``class MyTrainer(MixprecTrainerMixin, SFTTrainer)``):

- ``__init__``: ``mp.prepare(model)`` (fp32 islands, the output cast, 16-bit storage);
- ``compute_loss_context_manager``: ``mp.autocast()`` (training and evaluation forwards);
- ``compute_loss``: the loss's backward goes through the loss scaler (the loss's value, and so
  what the Trainer logs, stays unscaled);
- ``training_step``: after the backward, 16-bit gradients onto the fp32 masters; at the end of
  the accumulation window, unscale and clip to ``args.max_grad_norm`` (on the unscaled, fp32
  master gradients). mixprec clips, so the Trainer's ``_clip_grad_norm`` / ``_get_grad_norm``
  hand back mixprec's norm before clipping instead of clipping again; ``args`` stay as given, so
  ``training_args.bin`` and every logger record the ``max_grad_norm`` that was applied;
- ``create_optimizer``: the optimizer the Trainer builds (or yours, from ``optimizers=``) is moved
  onto the fp32 masters of a 16-bit storage recipe, and its ``step()`` becomes mixprec's: step
  or skip, scale update, write-back;
- ``create_scheduler``: a skipped step does not advance the lr scheduler;
- ``log``: ``mixprec/loss_scale`` (the last step's), ``mixprec/loss_scale_min`` and
  ``mixprec/skipped_steps`` (over the steps since the last log) join the Trainer's logs, and so
  every ``report_to`` integration (TensorBoard, W&B, MLflow); read back once per log, not per step;
- checkpoints: ``mixprec.pt`` (scaler and masters) in each ``checkpoint-N`` folder, written with the
  Trainer's own files (``_save_scaler``), before it deletes older checkpoints; read and checked by
  ``train(resume_from_checkpoint=...)`` before the Trainer loads the checkpoint, applied as training begins.

Refused with a message: ``TrainingArguments(fp16=True)`` / ``bf16=True`` (Accelerate's own mixed
precision: mixprec runs the recipe), ``accumulate=`` (the Trainer's ``gradient_accumulation_steps``
is the window), several processes, DeepSpeed, FSDP, ``model_init``.
Tested with transformers 5.24 and accelerate 1.15 on one device.
"""

from __future__ import annotations

import os
from typing import Any

import torch

try:
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint
except ImportError as e:  # the extra is not installed
    raise ImportError(f"mixprec.integrations.transformers needs transformers and accelerate ({e}): "
                      "pip install \"mixprec[transformers]\"") from e

from mixprec.integrations._common import (SkipAwareScheduler, check_version, load_state_file, rebind_to_masters,
                                          save_atomically)
from mixprec.integrations.records import StepWindow
from mixprec.recipes import Recipe
from mixprec.step_io import check_loadable
from mixprec.training import MixedPrecision, StepStats

#: the releases this integration is tested with: [minimum, below)
TESTED_TRANSFORMERS = ("5.24", "6")
TESTED_ACCELERATE = ("1.15", "2")
STATE_FILE = "mixprec.pt"


def check_versions(check: bool = True) -> None:
    check_version("transformers", *TESTED_TRANSFORMERS, extra="transformers", check=check)
    check_version("accelerate", *TESTED_ACCELERATE, extra="transformers", check=check)


class _ScaledBackward(torch.autograd.Function):
    """The loss's value, with its backward sent through the scaled loss: the gradient reaching the
    loss is the scale, exactly as ``scaler.scale(loss).backward()`` makes it, while the Trainer
    goes on dividing, logging and returning the unscaled value."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, scaled: torch.Tensor) -> torch.Tensor:
        return loss.detach().clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, grad


class _MixprecStep(torch.optim.Optimizer):
    """The Trainer's optimizer: the torch optimizer's state and groups, but ``step()`` is mixprec's
    (step or skip, update, write-back). Built by ``MixprecTrainerMixin.create_optimizer``."""

    def __init__(self, optimizer: torch.optim.Optimizer, owner: MixprecTrainerMixin) -> None:  # noqa: D107
        self.optimizer = optimizer
        self._owner = owner  # not Optimizer.__init__: the groups and state are the wrapped optimizer's

    param_groups = property(lambda self: self.optimizer.param_groups,
                            lambda self, v: setattr(self.optimizer, "param_groups", v))
    state = property(lambda self: self.optimizer.state, lambda self, v: setattr(self.optimizer, "state", v))
    defaults = property(lambda self: self.optimizer.defaults, lambda self, v: setattr(self.optimizer, "defaults", v))

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("mixprec's optimizer step takes no closure (the loss scaler cannot re-run backward)")
        self._owner._mixprec_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"mixprec step over {self.optimizer!r}"


def _find(obj: Any, cls: type) -> Any:
    """``obj`` or the first of its ``.optimizer`` chain (Accelerate's wrapper) that is a ``cls``."""
    seen = 0
    while obj is not None and seen < 8:
        if isinstance(obj, cls):
            return obj
        obj, seen = getattr(obj, "optimizer", None), seen + 1
    return None


class _MixprecCheckpoints(TrainerCallback):
    """Saves ``mixprec.pt`` beside each checkpoint and loads it when training resumes."""

    def __init__(self, owner: MixprecTrainerMixin) -> None:
        self.owner = owner

    def on_save(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        # a full checkpoint has its mixprec.pt already (MixprecTrainerMixin._save_scaler, before the Trainer
        # deletes older checkpoints); one of save_only_model (not resumable) gets it here
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if args.save_only_model and os.path.isdir(folder) and state.is_world_process_zero:
            _write_state(folder, self.owner.mp)

    def on_train_begin(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        saved, self.owner._mixprec_resume = self.owner._mixprec_resume, None
        if saved is not None:  # (read and checked by train(), before the Trainer loaded the checkpoint)
            self.owner.mp.load_state_dict(saved)


def _write_state(folder: str, mp: MixedPrecision) -> None:
    """``mp.state_dict()`` as the checkpoint ``folder``'s ``mixprec.pt``, written aside and renamed into place."""
    save_atomically(mp.state_dict(), os.path.join(folder, STATE_FILE))


def _read_state(folder: str, mp: MixedPrecision) -> dict[str, Any]:
    """The ``mixprec.pt`` of the checkpoint ``folder``, read and checked against ``mp`` (the recipe, the
    scaler, the masters) before anything of the checkpoint is loaded; refused with what to do."""
    path = os.path.join(folder, STATE_FILE)
    if not os.path.isfile(path):
        earlier = _last_with_state(os.path.dirname(os.path.abspath(folder)), below=folder)
        raise FileNotFoundError(
            f"resuming from {folder}, which has no {STATE_FILE}: it was not saved by a MixprecTrainer (or its "
            f"save was interrupted), so the loss scaler's state (and the fp32 masters of recipe "
            f"{mp.recipe.name!r}) cannot be restored. Resume from a checkpoint a MixprecTrainer saved"
            + (f" ({earlier} has one)" if earlier else "") + ", or start afresh."
        )
    what = (f"it holds the loss scaler's state (and the fp32 masters of recipe {mp.recipe.name!r}) "
            f"that MixprecTrainer saved beside the checkpoint")
    saved = load_state_file(path, mp.device, what)
    recipe = saved.get("recipe") if isinstance(saved, dict) else None
    if recipe is not None and recipe != mp.recipe.name:
        raise ValueError(
            f"{folder} was saved by a run of recipe {recipe!r}; this MixprecTrainer runs {mp.recipe.name!r}. "
            f"Resume with mixprec={recipe!r}, or start a new run from its weights (from_pretrained({folder!r}) "
            "and train() without resume_from_checkpoint)."
        )
    check_loadable(mp, saved, True)
    return saved


def _last_with_state(output_dir: str, below: str) -> str | None:
    """The newest ``checkpoint-N`` in ``output_dir`` before ``below`` that holds a ``mixprec.pt``."""
    def number(name: str) -> int:
        tail = name[len(PREFIX_CHECKPOINT_DIR) + 1:]
        return int(tail) if name.startswith(PREFIX_CHECKPOINT_DIR + "-") and tail.isdigit() else -1

    limit = number(os.path.basename(os.path.normpath(below)))
    try:
        names = os.listdir(output_dir)
    except OSError:
        return None
    found = [n for n in names if -1 < number(n) < (limit if limit >= 0 else float("inf"))
             and os.path.isfile(os.path.join(output_dir, n, STATE_FILE))]
    return os.path.join(output_dir, max(found, key=number)) if found else None


class MixprecTrainerMixin:
    """The precision parts of the Trainer's step, from mixprec (see the module's docstring).

    Args (keywords, beside the Trainer's own):
        mixprec: a recipe name (``"fp16-mixed"``, ``"bf16-true"``...), a ``Recipe``, or a
            ``MixedPrecision`` for the Trainer's device (``args.device``). Default ``"auto"``.
        mixprec_options: ``MixedPrecision`` keyword arguments when ``mixprec`` is a name
            (``{"scaler": {"hysteresis": 2}, "nan_guard": "warn"}``); grad-norm tracking is on.
        check_version: refuse a transformers/accelerate release outside the tested range.

    Attributes: ``mp``, ``last_stats`` (the last optimizer step's ``StepStats``).
    """

    def __init__(self, *args: Any, mixprec: str | Recipe | MixedPrecision = "auto",
                 mixprec_options: dict[str, Any] | None = None, check_version: bool = True, **kwargs: Any) -> None:
        check_versions(check_version)
        if not all(callable(getattr(Trainer, n, None)) for n in ("_clip_grad_norm", "_get_grad_norm", "_save_scaler")):
            raise RuntimeError(  # (a release outside the tested range, with check_version=False)
                "this transformers' Trainer has no _clip_grad_norm/_get_grad_norm/_save_scaler, through which "
                "MixprecTrainer clips once (mixprec's clip on the fp32 master gradients) and saves mixprec.pt "
                "into each checkpoint; use transformers "
                f"{TESTED_TRANSFORMERS[0]}+ (below {TESTED_TRANSFORMERS[1]})")
        args, kwargs, targs = _with_training_args(args, kwargs)
        _refuse_args(targs)
        self._max_grad_norm = float(targs.max_grad_norm or 0.0)
        mine = targs
        if kwargs.get("model_init") is not None:
            raise ValueError("MixprecTrainer needs model=: model_init (hyperparameter search) builds models "
                             "it has not prepared")
        if isinstance(mixprec, MixedPrecision):
            if mixprec_options:
                raise ValueError("mixprec_options apply when mixprec is a recipe; this MixedPrecision has its own")
            self.mp = mixprec
        else:
            self.mp = MixedPrecision(mixprec, mine.device, **{"track_grad_norm": True, **(mixprec_options or {})})
        if self.mp.device.type != mine.device.type:
            raise ValueError(f"the MixedPrecision runs on {self.mp.device}, the Trainer on {mine.device}; use one device")
        if self.mp.accumulate != 1:  # (the Trainer steps per its own window: it was ignored)
            raise ValueError(
                f"MixprecTrainer takes no accumulate= (got accumulate={self.mp.accumulate}): the Trainer owns "
                "gradient accumulation and steps every gradient_accumulation_steps batches, whatever accumulate= "
                f"says. Pass TrainingArguments(gradient_accumulation_steps={self.mp.accumulate}) instead, and "
                "drop accumulate= from the mixprec options.")
        super().__init__(*args, **kwargs)
        self._refuse_setup()
        self.model = self.mp.prepare(self.model)
        self.last_stats: StepStats | None = None
        self._window = StepWindow()  # read back when the Trainer logs
        self._window_loss: torch.Tensor | None = None
        self._grad_norm: torch.Tensor | None = None
        self._mixprec_resume: dict[str, Any] | None = None  # mixprec.pt, read by train()
        self.add_callback(_MixprecCheckpoints(self))

    def _refuse_setup(self) -> None:
        acc = self.accelerator
        if acc.num_processes > 1 or self.args.n_gpu > 1:
            raise ValueError(f"MixprecTrainer is tested on one device; this run has {acc.num_processes} processes "
                             f"and {self.args.n_gpu} GPUs per process. Run one process on one device.")
        if getattr(self, "is_deepspeed_enabled", False) or getattr(self, "is_fsdp_enabled", False):
            raise ValueError("MixprecTrainer does not run under DeepSpeed or FSDP (they own precision themselves)")
        if acc.mixed_precision != "no":
            raise ValueError(
                f"Accelerate is set to mixed_precision={acc.mixed_precision!r} (ACCELERATE_MIXED_PRECISION or "
                f"its config): it would autocast and scale on its own, beside recipe {self.mp.recipe.name!r}. "
                "Set it to 'no'; mixprec runs the recipe."
            )

    # ------------------------------------------------------------------ forward and backward

    def compute_loss_context_manager(self) -> Any:
        stack = super().compute_loss_context_manager()  # type: ignore[misc]
        stack.enter_context(self.mp.autocast())
        return stack

    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        out = super().compute_loss(model, inputs, return_outputs=return_outputs,  # type: ignore[misc]
                                   num_items_in_batch=num_items_in_batch)
        loss = out[0] if return_outputs else out
        if not (model.training and torch.is_grad_enabled() and isinstance(loss, torch.Tensor) and loss.requires_grad):
            return out
        loss = loss.float() if loss.dtype != torch.float32 else loss
        if self.mp.scaler.is_enabled():
            loss = _ScaledBackward.apply(loss, self.mp.scaler.scale(loss))
        return (loss, *out[1:]) if return_outputs else loss

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        loss = super().training_step(model, inputs, num_items_in_batch)  # type: ignore[misc]
        self._window_loss = loss if self._window_loss is None else self._window_loss + loss
        opts = [self._torch_optimizer()]
        boundary = bool(self.accelerator.sync_gradients)
        self.mp.after_backward(opts, boundary=boundary)
        if boundary:  # before the Trainer measures: unscaled, and clipped by mixprec
            self.mp.unscale_(opts)
            self._grad_norm = self.mp.clip_grad_norm_(opts, self._max_grad_norm or None)
        return loss

    def _clip_grad_norm(self, model: Any) -> Any:
        """The Trainer's clip, at the window's end: mixprec clipped in ``training_step`` (once, on the
        unscaled master gradients); this hands back its norm before clipping."""
        return self._grad_norm

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        return self._grad_norm if grad_norm is None else grad_norm  # (no second norm over the model)

    # ------------------------------------------------------------------ optimizer and scheduler

    def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
        opt = super().create_optimizer(model) if model is not None else super().create_optimizer()  # type: ignore[misc]
        if _find(opt, _MixprecStep) is None:
            rebind_to_masters(self.mp, [opt])
            self.optimizer = _MixprecStep(opt, self)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        sched = super().create_scheduler(num_training_steps, optimizer)  # type: ignore[misc]
        plateau = isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau) or type(sched).__name__ == "GreedyLR"
        if sched is not None and not plateau and not isinstance(sched, SkipAwareScheduler):
            self.lr_scheduler = sched = SkipAwareScheduler(sched, self.mp)  # stepped on metrics: not per step
        return sched

    def _torch_optimizer(self) -> torch.optim.Optimizer:
        step = _find(self.optimizer, _MixprecStep)
        if step is None:
            raise RuntimeError("the Trainer's optimizer was not made by MixprecTrainer.create_optimizer; if you "
                               "override create_optimizer, call super().create_optimizer()")
        return step.optimizer

    def _mixprec_step(self) -> None:
        loss, self._window_loss = self._window_loss, None
        stats = self.mp.optimizer_step([self._torch_optimizer()], loss=loss, grad_norm=self._grad_norm)
        self.last_stats, self._grad_norm = stats, None
        self._window.append(stats)

    # ------------------------------------------------------------------ logs and checkpoints

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if "loss" in logs:  # a training log: what the steps since the last one did (one read-back)
            window = self._window.read()
            if "mixprec/grad_norm" in window:
                norm = window.pop("mixprec/grad_norm")
                if "grad_norm" in logs:
                    logs["grad_norm"] = norm  # mixprec's, before clipping (the Trainer's came after)
            logs.update(window)
        super().log(logs, *args, **kwargs)  # type: ignore[misc]

    def _save_scaler(self, output_dir: str) -> None:
        """The Trainer saves its scaler into each checkpoint (after the optimizer, before its state and
        before it deletes older checkpoints): mixprec's scaler and masters go there as ``mixprec.pt``, so
        a save that dies leaves the previous, complete checkpoint in place."""
        super()._save_scaler(output_dir)  # type: ignore[misc]
        if self.args.should_save:
            _write_state(output_dir, self.mp)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"no checkpoint found in output directory {self.args.output_dir!r}")
        self._mixprec_resume = None
        if resume_from_checkpoint and os.path.isdir(resume_from_checkpoint):  # (else the Trainer says it is missing)
            self._mixprec_resume = _read_state(resume_from_checkpoint, self.mp)
        return super().train(resume_from_checkpoint, *args, **kwargs)  # type: ignore[misc]


class MixprecTrainer(MixprecTrainerMixin, Trainer):
    """``transformers.Trainer`` with a mixprec recipe: ``MixprecTrainer(..., mixprec="bf16-true")``."""


def _with_training_args(args: tuple, kwargs: dict) -> tuple[tuple, dict, TrainingArguments]:
    targs = kwargs.get("args", args[1] if len(args) > 1 else None)
    if targs is None:  # what the Trainer would make
        targs = TrainingArguments(output_dir="trainer_output")
        kwargs = {**kwargs, "args": targs}
    return args, kwargs, targs


def _refuse_args(targs: TrainingArguments) -> None:
    asked = [f"{k}=True" for k in ("fp16", "bf16", "fp16_full_eval", "bf16_full_eval") if getattr(targs, k, False)]
    if asked:
        raise ValueError(
            f"TrainingArguments({', '.join(asked)}) asks the Trainer and Accelerate for their own mixed precision "
            "(on CPU, fp16 silently trains in fp32). With MixprecTrainer the recipe is mixprec's: drop "
            f"{', '.join(asked)} and pass mixprec='fp16-mixed' (or 'bf16-mixed', 'bf16-true', ...)."
        )
    if getattr(targs, "deepspeed", None) or getattr(targs, "fsdp", None):
        raise ValueError("MixprecTrainer does not run under DeepSpeed or FSDP (they own precision themselves)")
