"""A Lightning precision plugin running a mixprec recipe: one line in the Trainer.

    import lightning as L
    from mixprec.integrations.lightning import MixprecPrecision

    trainer = L.Trainer(plugins=[MixprecPrecision("bf16-true-sr", nan_guard="warn")], max_steps=1000)

``MixprecPrecision(recipe, **options)`` takes what ``MixedPrecision`` takes (``scaler=``,
``fp32_modules=``, ``fp32_params=``, ``track_grad_norm=``, ``skip_nonfinite=``, ``nan_guard=``)
and does, at Lightning's hooks, what ``mp.step`` does in a hand-written loop, in the same order
and so with the same numbers:

- ``convert_module``: ``mp.prepare`` (fp32 islands, the output cast; 16-bit storage and masters);
- ``connect``: the optimizer that ``configure_optimizers`` built over ``self.parameters()`` is
  moved onto the fp32 masters (16-bit storage recipes), and step-interval lr schedulers are
  wrapped so that a skipped step does not advance them;
- ``forward_context``: ``mp.autocast()`` for the training, validation, test and predict steps;
- ``pre_backward`` / ``backward``: the loss scaled by mixprec's scaler; 16-bit gradients folded
  onto the masters after each backward;
- ``optimizer_step``: unscale, then Lightning's ``on_before_optimizer_step`` hooks and gradient
  clipping (``Trainer(gradient_clip_val=...)``: on the unscaled, fp32 master gradients), then
  step or skip, scale update, write-back;
- ``state_dict``: the scaler's and masters' state in Lightning's checkpoints (resume is bitwise);
  ``on_load_checkpoint``: ``fit(ckpt_path=...)`` from a checkpoint without it, or of another recipe,
  is refused; ``validate``/``test``/``predict`` take any checkpoint's weights.

Gradient accumulation is Lightning's (``Trainer(accumulate_grad_batches=N)``; the plugin takes
no ``accumulate=``). Each optimizer step's record (loss, scale, skipped, grad norm) goes to the
Trainer's loggers in batches of ``log_every_n_steps`` steps (one read-back per batch; tags
``mixprec/...``, at the optimizer step's number) and is at ``plugin.last_stats``.

Tested with lightning 2.6 on one device (``SingleDeviceStrategy``: CPU or one GPU). Other
strategies (DDP, FSDP, DeepSpeed) are refused with a message. Lightning's own ``precision=``
argument and this plugin exclude each other (Lightning says so).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

try:
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.strategies import SingleDeviceStrategy
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities import GradClipAlgorithmType
except ImportError as e:  # the extra is not installed
    raise ImportError(f"mixprec.integrations.lightning needs lightning ({e}): pip install \"mixprec[lightning]\"") from e

from mixprec.integrations._common import SkipAwareScheduler, check_version, rebind_to_masters
from mixprec.integrations.records import StepLog
from mixprec.recipes import Recipe
from mixprec.training import MixedPrecision, StepStats

#: the lightning releases this plugin is tested with: [minimum, below)
TESTED = ("2.6", "2.7")


def lightning_precision_name(recipe: Recipe) -> str:
    """The Lightning name nearest a recipe (``trainer.precision``; the model summary reads it)."""
    compute = recipe.policy.compute_dtype
    half = {torch.bfloat16: "bf16", torch.float16: "16"}.get(compute)
    if half is None:
        return "32-true"
    return f"{half}-true" if recipe.stores_16bit else f"{half}-mixed"


class MixprecPrecision(Precision):
    """Lightning precision plugin for a mixprec recipe (see the module's docstring).

    Args:
        recipe: a mixprec recipe name (``"bf16-mixed"``, ``"fp16-mixed"``, ``"bf16-true"``,
            ``"bf16-true-kahan"``, ``"bf16-true-sr"``, ``"fp16-true"``...), a jmp policy string or a
            ``Recipe``. ``"auto"`` is resolved for the Trainer's device.
        device: the device to run on; None (default) takes the Trainer's (its strategy's root device).
        log_steps: send each step's record to the Trainer's loggers (batched).
        check_version: refuse a lightning release outside the tested range (False: try it anyway).
        **options: ``MixedPrecision`` keyword arguments.

    Attributes: ``mp`` (the ``MixedPrecision``; rebuilt for the Trainer's device at setup),
    ``last_stats`` (the last optimizer step's ``StepStats``).
    """

    def __init__(self, recipe: str | Recipe = "auto", *, device: str | torch.device | None = None,
                 log_steps: bool = True, check_version: bool = True, **options: Any) -> None:
        check_version_of_lightning(check_version)
        if "accumulate" in options:
            raise ValueError(
                "MixprecPrecision takes no accumulate=: Lightning owns gradient accumulation. Pass "
                f"Trainer(accumulate_grad_batches={options['accumulate']!r}) instead."
            )
        self._recipe, self._device, self._options = recipe, device, options
        self.mp = MixedPrecision(recipe, device, **options)  # refuses bad arguments now, not at fit
        self.precision = lightning_precision_name(self.mp.recipe)  # type: ignore[assignment]
        self.log_steps = log_steps
        self.last_stats: StepStats | None = None
        self._records = StepLog(every=50)
        self._trainer: Any = None
        self._optimizers: list[torch.optim.Optimizer] = []
        self._loss_sum: torch.Tensor | None = None
        self._in_step = False  # the closure of optimizer_step is running (its backward is the boundary)
        self._boundary = False  # the last backward ended the accumulation window
        self._ready = False  # boundary reached and gradients unscaled for the coming step
        self._grad_norm: torch.Tensor | None = None
        self._load_state = True  # on_load_checkpoint: whether the checkpoint's mixprec state is loaded
        self._in_train_step = False  # inside Lightning's training_step
        self._stepped_in_train_step = False  # and an optimizer step ran in it
        self._noted: set[str] = set()  # schedulers already said to advance after a skipped step

    def __repr__(self) -> str:
        return f"MixprecPrecision({self.mp.recipe.name!r}, device={str(self.mp.device)!r})"

    # ------------------------------------------------------------------ setup

    def convert_module(self, module: nn.Module) -> nn.Module:
        trainer = _trainer_of(module)
        if trainer is not None:
            strategy = trainer.strategy
            if type(strategy) is not SingleDeviceStrategy:
                raise ValueError(
                    f"MixprecPrecision runs on one device (SingleDeviceStrategy); this Trainer uses "
                    f"{type(strategy).__name__}, which it is not tested with. Use Trainer(devices=1) "
                    "(strategy='auto'), or a hand-written loop with mp.step."
                )
            self._trainer = trainer
            self._bind_device(strategy.root_device)
            self._records.every = max(1, int(getattr(trainer, "log_every_n_steps", 50) or 50))
        module = module.to(self.mp.device)  # the strategy moves it there next; prepare checks it
        return self.mp.prepare(module)

    def _bind_device(self, device: torch.device) -> None:
        if self.mp.device == device or self.mp.device.type == device.type == "cpu":
            return
        if self._device is not None:
            raise ValueError(
                f"MixprecPrecision(device={str(self._device)!r}) but the Trainer runs on {device}; "
                "drop device= (the plugin takes the Trainer's) or pass the Trainer's device"
            )
        if self.mp.guard is not None or self.mp.masters is not None and self.mp.masters.slots:
            raise RuntimeError(f"this MixprecPrecision already prepared a model on {self.mp.device}; use a new one")
        self.mp = MixedPrecision(self._recipe, device, **self._options)
        self.precision = lightning_precision_name(self.mp.recipe)  # type: ignore[assignment]

    def connect(self, model: nn.Module, optimizers: list[torch.optim.Optimizer],
                lr_schedulers: list[Any]) -> tuple[nn.Module, list[torch.optim.Optimizer], list[Any]]:
        if self.mp.masters is not None and len(optimizers) > 1:
            raise ValueError(
                f"recipe {self.mp.recipe.name!r} stores parameters in 16 bits with one set of fp32 masters; "
                f"configure_optimizers returned {len(optimizers)} optimizers. Use one optimizer with "
                "parameter groups, or a recipe that stores parameters in fp32 (bf16-mixed, fp16-mixed)."
            )
        rebind_to_masters(self.mp, optimizers)
        self._optimizers = list(optimizers)
        manual = not getattr(model, "automatic_optimization", True)
        configs = []
        for c in lr_schedulers:
            if not isinstance(c.scheduler, SkipAwareScheduler):
                if getattr(c, "interval", None) == "step":
                    c = dataclasses.replace(c, scheduler=SkipAwareScheduler(c.scheduler, self.mp))
                elif manual:  # the user steps it, at a cadence Lightning does not know: said, not guessed
                    c = dataclasses.replace(c, scheduler=SkipAwareScheduler(
                        c.scheduler, self.mp, hold=False, note=self._unheld_note(type(c.scheduler).__name__)))
            configs.append(c)
        return model, optimizers, configs

    def _unheld_note(self, name: str) -> Callable[[], None]:
        def note() -> None:
            if not (self._in_train_step and self._stepped_in_train_step) or name in self._noted:
                return
            self._noted.add(name)
            warnings.warn(
                f"MixprecPrecision: in manual optimization a {name} was stepped right after an optimizer step the "
                "loss scaler skipped (fp16 overflow), and it advanced. If you step it once per optimizer step, "
                "return it from configure_optimizers with \"interval\": \"step\" ({\"scheduler\": sched, "
                "\"interval\": \"step\"}): the plugin then holds it on a skipped step, as mp.step does. If it "
                "is an epoch schedule stepped at the epoch's last batch, this is as intended.",
                RuntimeWarning, stacklevel=3)
        return note

    @contextlib.contextmanager
    def train_step_context(self) -> Any:
        """Lightning's training_step (in manual optimization: where the user steps optimizers and schedulers)."""
        self._in_train_step, self._stepped_in_train_step = True, False
        try:
            with super().train_step_context():
                yield
        finally:
            self._in_train_step = self._stepped_in_train_step = False

    # ------------------------------------------------------------------ forward and backward

    def forward_context(self) -> contextlib.AbstractContextManager:
        return self.mp.autocast()

    def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:  # type: ignore[override]
        loss = tensor.float() if tensor.dtype != torch.float32 else tensor
        detached = loss.detach()
        self._loss_sum = detached if self._loss_sum is None else self._loss_sum + detached
        return super().pre_backward(self.mp.scaler.scale(loss), module)

    def backward(self, tensor: torch.Tensor, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        super().backward(tensor, model, optimizer, *args, **kwargs)  # model.backward: the user's override
        optimizer = _unwrap(optimizer)
        opts = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else self._optimizers
        if opts:
            # inside optimizer_step's closure this backward ends the accumulation window
            self.mp.after_backward(opts, boundary=self._in_step)
            self._ready = False
            self._boundary = self._in_step

    # ------------------------------------------------------------------ the step

    def _prepare_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The boundary (if the closure's backward was not it) and unscale, once per step."""
        if self._ready:
            return
        if not self._boundary:
            self.mp.after_backward([optimizer], boundary=True)
        self.mp.unscale_([optimizer])
        self._ready, self._boundary, self._grad_norm = True, False, None

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:  # type: ignore[override]
        optimizer = _unwrap(optimizer)
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError("MixprecPrecision cannot run LBFGS: its closure re-runs backward inside step, "
                             "where a loss scaler cannot unscale or skip. Use another optimizer, or fp32 without the plugin.")
        if kwargs:
            raise ValueError(f"MixprecPrecision passes no extra arguments to optimizer.step; got {sorted(kwargs)}")
        self._in_step = True
        try:
            closure_result = closure()
        finally:
            self._in_step = False
        if closure_result is None and getattr(model, "automatic_optimization", True):
            # training_step returned None: no backward, nothing to step (as Lightning's own plugins)
            self._loss_sum, self._ready, self._boundary = None, False, False
            return closure_result
        self._prepare_step(optimizer)
        self._after_closure(model, optimizer)  # on_before_optimizer_step hooks, then Lightning's clipping
        grad_norm = self._grad_norm
        if grad_norm is None and self.mp.track_grad_norm:
            grad_norm = self.mp.clip_grad_norm_([optimizer], None)
        loss, self._loss_sum = self._loss_sum, None
        stats = self.mp.optimizer_step([optimizer], loss=loss, grad_norm=grad_norm)
        self._ready, self._grad_norm = False, None
        self._record(stats)
        self._stepped_in_train_step = self._in_train_step
        return closure_result

    def clip_gradients(self, optimizer: torch.optim.Optimizer, clip_val: int | float = 0.0,
                       gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM) -> None:
        if clip_val <= 0:
            return
        optimizer = _unwrap(optimizer)
        self._prepare_step(optimizer)  # manual optimization clips before opt.step(): unscale first
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            if self.mp.masters is not None:
                raise ValueError(
                    f"gradient_clip_algorithm='value' is not supported with recipe {self.mp.recipe.name!r} "
                    "(16-bit storage: the gradients live on the fp32 masters, some still in 16 bits until "
                    "their bucket steps); use gradient_clip_algorithm='norm'"
                )
            torch.nn.utils.clip_grad_value_(list(self.main_params(optimizer)), clip_value=clip_val)
            return
        self._grad_norm = self.mp.clip_grad_norm_([optimizer], float(clip_val))

    # ------------------------------------------------------------------ records and state

    def _record(self, stats: StepStats) -> None:
        self.last_stats = stats
        if self.log_steps:
            self._write(self._records.append(stats))

    def _write(self, records: list[tuple[int, dict[str, float]]]) -> None:
        if not records or self._trainer is None:
            return
        for logger in self._trainer.loggers:
            for step, metrics in records:
                logger.log_metrics(metrics, step=step)

    def flush_records(self) -> None:
        """Send the records still buffered to the Trainer's loggers (done at the end of fit)."""
        self._write(self._records.flush())

    def teardown(self) -> None:
        self.flush_records()
        super().teardown()

    def state_dict(self) -> dict[str, Any]:
        return self.mp.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Before Lightning loads this plugin's state from ``ckpt_path``: resuming ``fit`` needs the
        state of a run of the same recipe (else the scaler, the step count and the masters would
        restart without a word); ``validate``/``test``/``predict`` use the weights only."""
        self._load_state = True
        key = type(self).__qualname__  # where Lightning keeps (and looks up) a precision plugin's state
        fitting = self._trainer is None or self._trainer.state.fn == TrainerFn.FITTING
        state = checkpoint.get(key)
        if not fitting:
            # the weights are the checkpoint's; the scaler and masters of a training run are not used
            self._load_state = isinstance(state, dict) and state.get("recipe") == self.mp.recipe.name
            return
        if state is None:
            masters = f" (and the fp32 masters of recipe {self.mp.recipe.name!r})" if self.mp.recipe.stores_16bit else ""
            raise ValueError(
                f"Trainer.fit(ckpt_path=...) resumes from a checkpoint that holds no {key} state: it was not "
                f"saved by a run with this plugin, so the loss scaler and the step count{masters} cannot be "
                "restored. Resume from a checkpoint a "
                f"MixprecPrecision run saved, or start a new run from its weights: "
                "model.load_state_dict(torch.load(path)['state_dict']) and Trainer.fit without ckpt_path."
            )
        saved = state.get("recipe") if isinstance(state, dict) else None
        if saved != self.mp.recipe.name:
            raise ValueError(
                f"Trainer.fit(ckpt_path=...) resumes a run of recipe {saved!r} with MixprecPrecision("
                f"{self.mp.recipe.name!r}): its loss scaler and masters belong to {saved!r}. Resume with "
                f"MixprecPrecision({saved!r}), or start a new run from its weights "
                "(model.load_state_dict(torch.load(path)['state_dict']), Trainer.fit without ckpt_path)."
            )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        load, self._load_state = self._load_state, True
        if load:
            self.mp.load_state_dict(state_dict)


def check_version_of_lightning(check: bool = True) -> None:
    check_version("lightning", *TESTED, extra="lightning", check=check)


def _unwrap(optimizer: Any) -> Any:
    """The torch optimizer behind a LightningOptimizer (``self.optimizers()`` in manual optimization):
    the one the scaler and the masters know."""
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def _trainer_of(module: nn.Module) -> Any:
    """The Trainer a LightningModule is attached to, or None (a plain module, or Fabric)."""
    try:
        return getattr(module, "trainer", None)
    except RuntimeError:  # LightningModule.trainer raises when no Trainer is attached
        return None
