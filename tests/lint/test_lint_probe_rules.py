"""Missed and mis-worded findings that a probe of real scripts found (MP106, MP108, MP201), each
with the near miss that must stay silent."""

from __future__ import annotations

import textwrap

import pytest

from mixprec.lint import lint_source


def found(source: str, code: str) -> list[tuple[int, str]]:
    return [(f.line, f.message) for f in lint_source(textwrap.dedent(source)) if f.code == code]


PRETRAINED = """
import torch
from transformers import LlamaForCausalLM

def main(cfg):
    model = LlamaForCausalLM.from_pretrained(cfg.name, torch_dtype={dtype})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
"""


@pytest.mark.parametrize("other", ['"auto"', "None"])
def test_an_auto_or_none_arm_does_not_hide_the_fp16_arm_of_torch_dtype(other):
    # llama-recipes: torch_dtype=torch.float16 if train_config.use_fp16 else "auto"
    ((line, message),) = found(PRETRAINED.format(dtype=f"torch.float16 if cfg.use_fp16 else {other}"), "MP106")
    assert line == 6 and "cast to 16 bits when cfg.use_fp16 and" in message


def test_a_conditional_dtype_is_worded_by_its_test():
    ((_, message),) = found(PRETRAINED.format(dtype="torch.float16 if cfg.use_fp16 else torch.float32"), "MP106")
    assert "when cfg.use_fp16 and" in message and "else" not in message
    ((_, message),) = found(PRETRAINED.format(dtype="torch.float32 if cfg.fp32 else torch.bfloat16"), "MP106")
    assert "when not cfg.fp32 and" in message


@pytest.mark.parametrize("dtype", ['"auto"', "None", "torch.float32"])
def test_an_auto_fp32_or_default_torch_dtype_stays_silent(dtype):
    assert found(PRETRAINED.format(dtype=dtype), "MP106") == []


WRAPPED = """
import torch
import lightning as L
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision

def main(fabric, accelerator, config):
    model = Net(config).bfloat16()
    model = {wrap}
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-5)
"""


@pytest.mark.parametrize("wrap", [
    "fabric.setup_module(model)",  # lit-llama
    "fabric.setup(model)",
    "accelerator.prepare(model)",
    "FSDP(model)",
    "FSDP(model, device_id=0)",
])
def test_a_set_up_that_keeps_the_parameters_keeps_the_cast(wrap):
    assert [line for line, _ in found(WRAPPED.format(wrap=wrap), "MP106")] == [7]


@pytest.mark.parametrize("wrap", [
    "FSDP(model, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))",
    "get_peft_model(model, config)",
    "build(model)",  # a project function the linter cannot see into may change anything
])
def test_a_set_up_that_may_change_the_parameters_stays_silent(wrap):
    assert found(WRAPPED.format(wrap=wrap), "MP106") == []


def test_a_fabric_or_accelerator_built_for_deepspeed_or_fsdp_stays_silent():
    source = """
    import torch
    import lightning as L
    from accelerate import Accelerator, FullyShardedDataParallelPlugin

    def main(config):
        fabric = L.Fabric(strategy="deepspeed_stage_2", precision="bf16-mixed")
        model = Net(config).bfloat16()
        model = fabric.setup_module(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-5)
        accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())
        net = Net(config).half()
        net = accelerator.prepare(net)
        opt = torch.optim.AdamW(net.parameters(), lr=3e-5)
    """
    assert found(source, "MP106") == []


PEFT = """
import torch
from peft import LoraConfig, get_peft_model

def main(args, accelerator):
    unet = UNet.from_pretrained(args.model)
    weight_dtype = torch.float32
    if accelerator.mixed_precision == "fp16":
        weight_dtype = torch.float16
    {before}
    unet.to(accelerator.device, dtype=weight_dtype)
    {after}
    params = [p for p in unet.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
"""


def test_adapters_added_before_the_cast_are_cast_too():
    source = PEFT.format(before="unet = get_peft_model(unet, LoraConfig(r=4))", after="pass")
    assert [line for line, _ in found(source, "MP106")] == [11]


@pytest.mark.parametrize("after", ["unet = get_peft_model(unet, LoraConfig(r=4))", "unet.add_adapter(LoraConfig(r=4))",
                                   "cast_training_params(unet, dtype=torch.float32)"])
def test_adapters_added_or_upcast_after_the_cast_stay_silent(after):
    assert found(PEFT.format(before="pass", after=after), "MP106") == []


def test_a_star_import_of_torch_cuda_amp_is_deprecated():
    source = """
    import torch
    from torch.cuda.amp import *

    def train(model, opt, loader):
        scaler = GradScaler()
        with autocast():
            loss = model(loader)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    """
    ((line, message),) = found(source, "MP201")
    assert line == 3 and "torch.cuda.amp.autocast, torch.cuda.amp.GradScaler" in message
    assert "custom_fwd" not in message  # only the names the file uses


def test_a_star_import_of_torch_amp_or_a_project_module_is_not_deprecated():
    assert found("import torch\nfrom torch.amp import *\nfrom utils import *\n", "MP201") == []


def test_mp108_cites_the_backward_the_fp16_region_feeds():
    # llm.c: an fp32 backward() of a debug pass runs before the training loop's autocast region
    source = """
    import torch
    from contextlib import nullcontext

    def main(args, model, optimizer, loader, device_type):
        ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}[args.dtype]
        ctx = torch.amp.autocast(device_type=device_type, dtype=ptdtype) if device_type == "cuda" else nullcontext()
        if args.write_tensors:
            logits, loss = model(x, y)
            loss.backward()
        for step in range(args.num_iterations):
            with ctx:
                _, loss = model(x, y)
            loss.backward()
            optimizer.step()
    """
    ((_, message),) = found(source, "MP108")
    assert "backward() on line 14 runs on an unscaled loss" in message
