"""Patterns from real training code that the rules used to report wrongly (issue 31, item 4)."""

from __future__ import annotations

import textwrap

from mixprec.lint import lint_source


def codes(source: str, only: str | None = None) -> list[tuple[int, str]]:
    found = [(f.line, f.code) for f in lint_source(textwrap.dedent(source))]
    return [x for x in found if only is None or x[1] == only]


def test_a_loggers_log_method_in_a_loss_is_not_torch_log():
    source = """
    import torch
    import torch.nn.functional as F

    class Trainer:
        def compute_loss(self, out, y):
            loss = F.cross_entropy(out, y)
            self.logger.log({"train/loss": loss.item()})
            self.log("loss", loss)  # Lightning's LightningModule.log
            return loss

        def train_step(self, x, y):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = self.model(x)
                loss = self.compute_loss(out, y)
            loss.backward()
    """
    assert codes(source, "MP110") == []


def test_a_tensor_log_in_a_loss_is_still_found_next_to_a_logger():
    source = """
    import torch

    class Trainer:
        def compute_loss(self, p, y):
            self.logger.log({"p": p.mean().item()})
            return -(y * p.log()).mean()

        def train_step(self, x, y):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = self.compute_loss(self.model(x), y)
            loss.backward()
    """
    assert codes(source, "MP110") == [(11, "MP110")]


FOCAL = """
import torch

def focal_loss(logits, target, gamma):
    p = torch.sigmoid(logits)
    return ((1 - p) ** gamma * torch.log(p)).mean()

def train(model, x, y, opt):
    with torch.autocast({device}, dtype=torch.bfloat16):
        loss = focal_loss(model(x), y, 2.0)
    loss.backward()
    opt.step()
"""


def test_pow_and_log_run_in_fp32_under_cuda_autocast_so_a_loss_of_them_is_not_16_bit():
    # both ops are on CUDA autocast's fp32 list: the loss is computed in fp32 already
    assert codes(FOCAL.format(device='"cuda"'), "MP110") == []


def test_pow_and_log_stay_16_bit_under_cpu_autocast():
    # CPU autocast's fp32 list has neither: they run in bf16 there
    assert codes(FOCAL.format(device='"cpu"'), "MP110") == [(10, "MP110")]


def test_sqrt_and_a_tiny_epsilon_stay_16_bit_under_cuda_fp16_autocast():
    source = """
    import torch

    def dist_loss(a, b):
        return (a - b).pow(2).sum(-1).sqrt().mean()

    def ratio_loss(a, b):
        return (a / (b + 1e-8)).mean()

    def train(model, x, y, opt, scaler):
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(x)
            loss = dist_loss(out, y) + ratio_loss(out, y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    """
    assert codes(source, "MP110") == [(13, "MP110"), (13, "MP110")]


def test_update_with_a_new_scale_sets_the_scale_and_is_not_a_second_update():
    source = """
    import torch
    scaler = torch.amp.GradScaler("cuda")
    for x in loader:
        with torch.autocast("cuda"):
            loss = model(x)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        if scaler.get_scale() > 32768.0:
            scaler.update(32768.0)  # cap the scale: documented, needs no inf checks
        if scaler.get_scale() < 1.0:
            scaler.update(new_scale=1.0)
    """
    assert codes(source, "MP105") == []


def test_two_plain_updates_in_one_step_are_still_reported():
    source = """
    import torch
    scaler = torch.amp.GradScaler("cuda")
    for x in loader:
        with torch.autocast("cuda"):
            loss = model(x)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scaler.update()
    """
    assert codes(source, "MP105") == [(10, "MP105")]


def test_a_direct_step_in_the_arm_where_scaling_is_off_is_not_a_bypass_across_a_helper():
    # composer's trainer: the helper scales (or not) on a flag, the caller steps on the same flag
    source = """
    import torch

    class Trainer:
        def _train_microbatches(self, microbatches, use_grad_scaling):
            for mb in microbatches:
                loss = self.model(mb)
                if use_grad_scaling:
                    self.scaler.scale(loss).backward()
                else:
                    loss.backward()
            if use_grad_scaling:
                for optimizer in self.optimizers:
                    self.scaler.unscale_(optimizer)

        def train_batch(self, batch):
            use_grad_scaling = self._use_grad_scaling(self.precision, self.scaler)
            self._train_microbatches(batch, use_grad_scaling)
            for optimizer in self.optimizers:
                if use_grad_scaling:
                    self.scaler.step(optimizer)
                else:
                    optimizer.step()
            self.scaler.update()
    """
    assert codes(source) == []


SCHEDULED = """
import torch

def run_train(model, loader, optimizer, scheduler, scaler, accum):
    for it, batch in enumerate(loader):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(batch)
        scaler.scale(loss).backward()
        if it % accum == 0:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        {scheduler_step}

def main(cfg, model, loader):
    optimizer = get_optimizer(model, cfg)
    scheduler = get_scheduler(cfg, optimizer, 100)
    run_train(model, loader, optimizer, scheduler, torch.amp.GradScaler("cuda"), 4)
"""


def test_a_scheduler_built_by_a_factory_over_the_optimizer_is_judged_by_that_optimizer():
    found = codes(SCHEDULED.format(scheduler_step="scheduler.step()"), "MP120")
    assert found == [(13, "MP120")]


def test_a_scheduler_stepped_on_a_metric_or_an_epoch_is_not_a_per_step_schedule():
    assert codes(SCHEDULED.format(scheduler_step="scheduler.step(val_score)"), "MP120") == []


def test_per_parameter_checks_in_an_occasional_logging_round_are_not_a_per_step_sync():
    source = """
    import torch

    def train(model, loader, optimizer, every):
        for step, batch in enumerate(loader):
            model(batch).backward()
            optimizer.step()
            if step % every == 0:
                for name, value in model.named_parameters():
                    if not (torch.isinf(value.grad) | torch.isnan(value.grad)).any():
                        log(name, value.grad)
    """
    assert codes(source, "MP119") == []


def test_any_over_a_generator_of_gradient_checks_syncs_once_per_parameter():
    source = """
    import torch

    def optimize_fp16(self):
        if any(not torch.isfinite(p.grad).all() for p in self.model_params):
            self.lg_loss_scale -= 1
            return
    """
    assert codes(source, "MP119") == [(5, "MP119")]
