"""A training step spread over the files of one project (issue 31, item 1).

``mixprec lint path/to/repo`` reads the repository as a whole: a call into another module of
the project is followed, with its parameters bound to what the caller passed, so a scaler made
in ``main``, stepped in ``engine.train_one_epoch`` and saved by ``utils.save_checkpoint`` is
one object.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from mixprec.lint import lint_paths


def project(tmp_path: Path, files: dict[str, str]) -> list[tuple[str, int, str]]:
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'p'\n")
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    result = lint_paths([tmp_path])
    return sorted((Path(f.path).relative_to(tmp_path).as_posix(), f.line, f.code) for f in result.findings)


def test_backward_in_a_helper_of_another_module_called_inside_autocast_is_reported_at_the_call(tmp_path):
    found = project(tmp_path, {
        "models/contrastive.py": """
            def contrastive_forward(model, inputs, scaler):
                for view in inputs:
                    loss = model(view)
                    scaler.scale(loss).backward()
                return loss
            """,
        "train.py": """
            import torch
            from models.contrastive import contrastive_forward

            def train_epoch(model, loader, optimizer, scaler):
                for inputs in loader:
                    with torch.autocast("cuda", dtype=torch.float16):
                        loss = contrastive_forward(model, inputs, scaler)
                    scaler.step(optimizer)
                    scaler.update()
            """,
    })
    assert found == [("train.py", 8, "MP102")]


def test_a_module_imported_as_a_package_attribute_is_followed(tmp_path):
    found = project(tmp_path, {
        "slowfast/__init__.py": "",
        "slowfast/models/__init__.py": "from .contrastive import *\n",
        "slowfast/models/contrastive.py": """
            def forward_backward(model, x):
                loss = model(x)
                loss.backward()
                return loss
            """,
        "tools/train_net.py": """
            import torch
            import slowfast.models as models

            def train(model, loader, opt):
                for x in loader:
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        models.forward_backward(model, x)
                    opt.step()
            """,
    })
    assert found == [("tools/train_net.py", 8, "MP102")]


def test_locals_of_two_helpers_called_one_after_the_other_are_two_objects(tmp_path):
    # train_baseline scales a loss with its own scaler; train_integration steps its own
    # optimizer directly: two training runs in sequence, not one step bypassing a scaler
    found = project(tmp_path, {
        "bench.py": """
            import torch

            def train_baseline(model, loader):
                optimizer = torch.optim.AdamW(model.parameters())
                scaler = torch.amp.GradScaler("cuda")
                for batch in loader:
                    with torch.autocast("cuda", dtype=torch.float16):
                        loss = model(batch)
                    scaler.scale(loss).backward()
                    scaler.step(optimizer)
                    scaler.update()

            def train_integration(model, loader, accelerator):
                optimizer = torch.optim.AdamW(model.parameters())
                for batch in loader:
                    loss = model(batch)
                    accelerator.backward(loss)
                    optimizer.step()

            if __name__ == "__main__":
                train_baseline(net, data)
                train_integration(net, data, acc)
            """,
    })
    assert found == []


def test_a_call_of_a_loss_scaler_object_counts_as_using_a_scaler(tmp_path):
    # timm's NativeScaler: ``loss_scaler(loss, optimizer)`` scales, steps and updates
    found = project(tmp_path, {
        "train.py": """
            import torch
            from contextlib import suppress
            from timm.utils import NativeScaler

            amp_autocast = suppress
            loss_scaler = None
            if args.amp:
                amp_autocast = torch.cuda.amp.autocast
                loss_scaler = NativeScaler()

            def train_epoch(model, loader, optimizer, amp_autocast=suppress, loss_scaler=None):
                for x, y in loader:
                    with amp_autocast():
                        loss = model(x, y)
                    optimizer.zero_grad()
                    if loss_scaler is not None:
                        loss_scaler(loss, optimizer, clip_grad=1.0)
                    else:
                        loss.backward()
                        optimizer.step()
            """,
    })
    assert [f for f in found if f[2] != "MP201"] == []


def test_an_autocast_factory_passed_as_a_parameter_is_an_autocast_in_the_callee(tmp_path):
    found = project(tmp_path, {
        "engine.py": """
            def train_one_epoch(model, loader, optimizer, amp_autocast):
                for x in loader:
                    with amp_autocast():
                        loss = model(x)
                        loss.backward()
                    optimizer.step()
            """,
        "main.py": """
            import torch
            from functools import partial
            from engine import train_one_epoch

            def main(model, loader, optimizer):
                amp_autocast = partial(torch.autocast, device_type="cpu", dtype=torch.bfloat16)
                train_one_epoch(model, loader, optimizer, amp_autocast)
            """,
    })
    assert found == [("main.py", 8, "MP102")]


def test_a_checkpoint_saved_by_a_helper_of_another_module_is_judged_at_the_call(tmp_path):
    found = project(tmp_path, {
        "yolox/__init__.py": "",
        "yolox/utils/__init__.py": "from .checkpoint import load_ckpt, save_checkpoint\n",
        "yolox/utils/checkpoint.py": """
            import os
            import torch

            def load_ckpt(model, ckpt):
                return model

            def save_checkpoint(state, is_best, save_dir, model_name=""):
                filename = os.path.join(save_dir, model_name + "_ckpt.pth")
                torch.save(state, filename)
            """,
        "yolox/core/trainer.py": """
            import torch
            from yolox.utils import save_checkpoint

            class Trainer:
                def __init__(self, args):
                    self.scaler = torch.cuda.amp.GradScaler(enabled=args.fp16)

                def train_one_iter(self, inps, targets):
                    with torch.cuda.amp.autocast(enabled=self.amp_training):
                        loss = self.model(inps, targets)
                    self.optimizer.zero_grad()
                    self.scaler.scale(loss).backward()
                    self.scaler.step(self.optimizer)
                    self.scaler.update()

                def save_ckpt(self, name, best=False):
                    ckpt_state = {
                        "start_epoch": self.epoch + 1,
                        "model": self.model.state_dict(),
                        "optimizer": self.optimizer.state_dict(),
                    }
                    save_checkpoint(ckpt_state, best, self.file_name, name)
            """,
    })
    assert [f for f in found if f[2] != "MP201"] == [("yolox/core/trainer.py", 23, "MP111")]


WRITER = """
import torch

def save_checkpoint(model, optimizer, learning_rate, iteration, path{extra}):
    torch.save(
        {{
            "model": model.state_dict(),
            "iteration": iteration,
            "optimizer": optimizer.state_dict(),
            "learning_rate": learning_rate,{entry}
        }},
        path,
    )
"""

TRAIN = """
import torch
from train import utils

def train_and_evaluate(epoch, net_g, optim_g, scaler, loader, hps):
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = net_g(x, y)
        optim_g.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optim_g)
        scaler.update()
    utils.save_checkpoint(net_g, optim_g, hps.lr, epoch, "G.pth"{passed})
"""


def test_a_project_function_that_writes_a_checkpoint_without_the_callers_scaler_is_reported_at_the_call(tmp_path):
    found = project(tmp_path, {
        "train/__init__.py": "",
        "train/utils.py": WRITER.format(extra="", entry=""),
        "train/train.py": TRAIN.format(passed=""),
    })
    assert found == [("train/train.py", 13, "MP111")]


def test_a_checkpoint_writer_given_the_scaler_is_clean(tmp_path):
    found = project(tmp_path, {
        "train/__init__.py": "",
        "train/utils.py": WRITER.format(extra=", scaler=None", entry='\n            "scaler": scaler.state_dict(),'),
        "train/train.py": TRAIN.format(passed=", scaler=scaler"),
    })
    assert found == []


def test_a_scaler_built_in_main_and_stepped_in_a_helper_is_missing_from_mains_checkpoint(tmp_path):
    found = project(tmp_path, {
        "engine.py": """
            import torch

            def train_one_epoch(model, loader, optimizer, scaler):
                for x, y in loader:
                    with torch.autocast("cuda", dtype=torch.float16):
                        loss = model(x, y)
                    scaler.scale(loss).backward()
                    scaler.step(optimizer)
                    scaler.update()
            """,
        "main.py": """
            import torch
            from engine import train_one_epoch

            def main(args, model, loader):
                optimizer = torch.optim.AdamW(model.parameters())
                scaler = torch.amp.GradScaler("cuda")
                for epoch in range(args.epochs):
                    train_one_epoch(model, loader, optimizer, scaler)
                    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}
                    torch.save(state, "checkpoint.pth")
            """,
    })
    assert found == [("main.py", 11, "MP111")]


def test_a_checkpointer_built_with_the_optimizer_but_not_the_scaler_is_reported(tmp_path):
    found = project(tmp_path, {
        "train.py": """
            from fvcore.common.checkpoint import Checkpointer

            def do_train(cfg, model, optimizer):
                fp16_scaler = model.fp16_scaler
                checkpointer = Checkpointer(model, cfg.output_dir, optimizer=optimizer, save_to_disk=True)
                for data in loader:
                    loss = model(data)
                    fp16_scaler.scale(loss).backward()
                    fp16_scaler.step(optimizer)
                    fp16_scaler.update()
                    checkpointer.save("model")
            """,
        "trainer.py": """
            from detectron2.checkpoint import DetectionCheckpointer

            class Trainer:
                def build(self, cfg, model):
                    self.grad_scaler = model.grad_scaler
                    self.checkpointer = DetectionCheckpointer(model, cfg.OUTPUT_DIR, trainer=self)

                def step(self, loss):
                    self.grad_scaler.scale(loss).backward()
                    self.grad_scaler.step(self.optimizer)
                    self.grad_scaler.update()
            """,
    })
    assert found == [("train.py", 6, "MP111")]
