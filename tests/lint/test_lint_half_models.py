"""MP106 on the spellings real scripts use (issue 31, items 2 and 3)."""

from __future__ import annotations

import textwrap
from pathlib import Path

from mixprec.lint import lint_paths, lint_source


def codes(source: str) -> list[tuple[int, str]]:
    return [(f.line, f.code) for f in lint_source(textwrap.dedent(source)) if f.code == "MP106"]


def test_a_half_model_moved_to_the_gpu_or_wrapped_in_ddp_stays_16_bit():
    source = """
    import torch

    model = Net()
    model = model.half()
    model = model.cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def build(device):
        net = Net().half()
        net = net.to(device)
        net = torch.nn.parallel.DistributedDataParallel(net)
        return torch.optim.AdamW(net.parameters())
    """
    assert codes(source) == [(5, "MP106"), (10, "MP106")]


def test_a_model_cast_back_to_fp32_or_rebuilt_before_its_optimizer_is_clean():
    source = """
    import torch

    model = Net().half()
    model = model.float()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    base = Net().to(torch.bfloat16)
    base = get_peft_model(base, config)
    opt2 = torch.optim.AdamW(base.parameters())
    """
    assert codes(source) == []


WEIGHT_DTYPE = """
import torch

weight_dtype = torch.float32
if accelerator.mixed_precision == "fp16":
    weight_dtype = torch.float16
elif accelerator.mixed_precision == "bf16":
    weight_dtype = torch.bfloat16
"""


def test_a_model_cast_to_a_run_time_dtype_after_its_optimizer_was_built_is_reported():
    source = WEIGHT_DTYPE + """
params_to_optimize = filter(lambda p: p.requires_grad, vae.parameters())
optimizer_class = bnb.optim.AdamW8bit if args.use_8bit_adam else torch.optim.AdamW
optimizer = optimizer_class(params_to_optimize, lr=1e-4)
disc_optimizer = optimizer_class(discriminator.heads.parameters(), lr=1e-4)
vae.to(accelerator.device, dtype=weight_dtype)
discriminator.to(accelerator.device, dtype=weight_dtype)
for batch in loader:
    accelerator.backward(vae(batch).loss)
    optimizer.step()
"""
    found = lint_source(source)
    assert [(f.line, f.code) for f in found] == [(14, "MP106"), (15, "MP106")]
    assert "when weight_dtype is 16-bit after its optimizer was built" in found[0].message


def test_an_optimizer_built_by_a_helper_over_a_cast_model_is_reported():
    source = WEIGHT_DTYPE + """
def setup_optimizer(unet, args):
    return torch.optim.AdamW(unet.parameters(), lr=args.lr)

unet = unet.to(device, dtype=weight_dtype)
optimizer = setup_optimizer(unet, args)
"""
    assert [(f.line, f.code) for f in lint_source(source) if f.code == "MP106"] == [(13, "MP106")]


def test_an_optimizer_built_in_another_module_of_the_project_is_followed(tmp_path):
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'p'\n")
    (tmp_path / "optimizer.py").write_text(textwrap.dedent("""
        from torch import optim

        def set_weight_decay(model):
            return [{"params": [p for n, p in model.named_parameters() if p.ndim > 1]}]

        def build_optimizer(config, model):
            parameters = set_weight_decay(model)
            return optim.AdamW(model.parameters(), lr=config.lr)
        """))
    (tmp_path / "main.py").write_text(textwrap.dedent("""
        import torch
        from optimizer import build_optimizer

        model = build_model(config).bfloat16()
        optimizer = build_optimizer(config, model)
        """))
    found = [(Path(f.path).name, f.line, f.code) for f in lint_paths([tmp_path]).findings]
    assert found == [("main.py", 5, "MP106")]


def test_a_cast_in_the_arm_where_the_model_is_not_trained_or_after_training_is_clean():
    source = WEIGHT_DTYPE + """
params_to_optimize = (
    itertools.chain(unet.parameters(), text_encoder.parameters()) if args.train_text_encoder else unet.parameters()
)
optimizer = torch.optim.AdamW(params_to_optimize, lr=1e-4)
if not args.train_text_encoder and text_encoder is not None:
    text_encoder.to(accelerator.device, dtype=weight_dtype)
for batch in loader:
    accelerator.backward(unet(batch).loss)
    optimizer.step()
unet.to(torch.float16)  # after training: to save half-size weights
unet.save_pretrained("out")
"""
    assert [f for f in lint_source(source) if f.code == "MP106"] == []


def test_adapters_upcast_for_training_and_sharded_accelerate_set_ups_are_clean():
    source = WEIGHT_DTYPE + """
unet.to(accelerator.device, dtype=weight_dtype)
unet.add_adapter(unet_lora_config)
cast_training_params(unet, dtype=torch.float32)
optimizer = torch.optim.AdamW(filter(lambda p: p.requires_grad, unet.parameters()))

acc = Accelerator(mixed_precision="bf16", fsdp_plugin=plugin)
model = AutoModelForCausalLM.from_pretrained(name, torch_dtype=torch.bfloat16)
opt = torch.optim.SGD(model.parameters(), lr=1e-5)
model, opt = acc.prepare(model, opt)
"""
    assert [f for f in lint_source(source) if f.code == "MP106"] == []


def test_a_pretrained_model_loaded_in_a_run_time_16_bit_dtype_and_trained_is_reported():
    source = """
    import torch

    load_dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    model = AutoModelForCausalLM.from_pretrained(name, dtype=load_dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model, optimizer = accelerator.prepare(model, optimizer)
    """
    found = lint_source(textwrap.dedent(source))
    assert [(f.line, f.code) for f in found] == [(5, "MP106")]
    assert "when load_dtype is 16-bit" in found[0].message


def test_parameters_returned_by_a_helper_are_the_models():
    source = """
    import torch
    from torch.optim import Adam

    def get_trainable_params(model):
        return [params for params in model.parameters() if params.requires_grad]

    dalle = DALLE(vae=vae)
    if args.fp16:
        dalle = dalle.half()
    dalle = dalle.cuda()
    opt = Adam(get_trainable_params(dalle), lr=3e-4)
    """
    assert codes(source) == [(10, "MP106")]
