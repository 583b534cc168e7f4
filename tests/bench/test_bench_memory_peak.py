"""Activation memory and the matmul peak."""

import pytest
import torch
from mixprec_test_env import bf16_sdpa_error
from torch import nn

from mixprec.bench.block import SHAPES, make_batches
from mixprec.instruments.activations import SavedTensorMeter, measure_activation_memory
from mixprec.bench.peak import measure_matmul_peak, peak_key, tf32
from mixprec.bench.runner import Trainer, Variant


def test_saved_tensor_meter_counts_each_storage_once_and_skips_excluded():
    a = torch.randn(100, requires_grad=True)
    b = torch.randn(100, requires_grad=True)
    with SavedTensorMeter() as m:
        (a * a).sum()  # saves a twice: one storage
    assert m.bytes == 400
    with SavedTensorMeter(exclude=[b]) as m:
        (a * b).sum()
    assert m.bytes == 400


def test_linear_activation_is_its_input_not_its_weight():
    lin = nn.Linear(8, 4)
    x = torch.randn(16, 8)
    h = x * 2  # created in the forward: counted
    mem = measure_activation_memory(lambda: lin(x * 2).sum(), lin, torch.device("cpu"), inputs=[x])
    assert mem["saved_bytes"] == h.nbytes
    assert mem["cuda_forward_delta"] is None


def test_bf16_mixed_saves_at_most_0_8x_the_activation_bytes_of_fp32():
    if bf16_sdpa_error():
        pytest.skip(bf16_sdpa_error())
    # Per token the block saves 64*d bytes in fp32 and 36*d in bf16-mixed (the residual stream and
    # the norm islands stay fp32), plus bf16 weight copies: 0.75x at this shape, 0.59x at ref.
    shape, dev = SHAPES["small"], torch.device("cpu")
    batches = make_batches(shape, dev, count=1)
    saved = {r: Trainer(Variant(r), shape, dev, "foreach", 1.0, batches).memory()["saved_bytes"]
             for r in ("fp32", "bf16-mixed")}
    d, tokens = shape.d_model, shape.tokens
    assert saved["fp32"] == pytest.approx(64 * d * tokens, rel=0.02)
    bf16_weights = 2 * 12 * d * d
    assert saved["bf16-mixed"] == pytest.approx(36 * d * tokens + bf16_weights, rel=0.02)
    assert saved["bf16-mixed"] <= 0.8 * saved["fp32"]


def test_tf32_context_sets_and_restores_matmul_precision():
    before = torch.get_float32_matmul_precision()
    with tf32(True):
        assert torch.get_float32_matmul_precision() == "high"
        with tf32(False):
            assert torch.get_float32_matmul_precision() == "highest"
        assert torch.get_float32_matmul_precision() == "high"
    assert torch.get_float32_matmul_precision() == before


def test_peak_key_names_the_compute_dtype_and_tf32_only_on_cuda():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert peak_key(torch.float32, True, cpu) == "f32"
    assert peak_key(torch.float32, True, cuda) == "tf32"
    assert peak_key(torch.float32, False, cuda) == "f32"
    assert peak_key(torch.bfloat16, True, cuda) == "bf16"
    assert peak_key(torch.float16, False, cpu) == "f16"


def test_matmul_peak_reports_the_faster_layout():
    p = measure_matmul_peak("bf16", torch.device("cpu"), n=64, repeat=1, rounds=1)
    assert p["n"] == 64 and p["dtype"] == "torch.bfloat16"
    assert set(p["layouts"]) == {"nn", "nt"}
    assert p["flops_per_s"] == pytest.approx(2 * 64**3 / min(p["layouts"].values()))


def _adamw_block(shape, recipe):
    dev = torch.device("cpu")
    t = Trainer(Variant(recipe), shape, dev, "foreach", 1.0, make_batches(shape, dev, count=1))
    t.step()  # the optimizer state exists from the first step on
    return t


@pytest.mark.parametrize("recipe, bytes_per_param", [("fp32", 4 + 8), ("bf16-mixed", 4 + 8), ("bf16-true", 2 + 4 + 8),
                                                     ("bf16-true-kahan", 2 + 2 + 8), ("bf16-true-sr", 2 + 8)])
def test_persistent_bytes_are_weights_masters_and_adamw_state(recipe, bytes_per_param):
    shape = SHAPES["tiny"]
    t = _adamw_block(shape, recipe)
    n = sum(p.numel() for p in t.model.parameters())
    kept = 0
    if recipe.startswith("bf16-true"):  # norms stay fp32 (no master: 4 + 8 bytes each)
        kept = sum(p.numel() for p in t.model.parameters() if p.dtype == torch.float32)
    steps = len(t.opt.state) * 4  # AdamW's step counter: one fp32 scalar per parameter
    # the compact strategies' proxies between steps: a scalar expanded to the shape (no per-element bytes)
    placeholders = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                    for g in t.opt.param_groups for p in g["params"] if p.numel() > 1 and not any(p.stride())}
    assert len(placeholders) <= 1
    assert t.persistent_bytes() == (n - kept) * bytes_per_param + kept * 12 + steps + sum(placeholders.values())


def test_cpu_step_peak_counts_this_variant_only_and_activations_come_first():
    shape = SHAPES["tiny"]
    t = _adamw_block(shape, "fp32")
    mem = t.memory()
    # every ratio here is a count of the same storages: no timing, no allocator
    assert mem["forward_delta"] >= mem["saved_bytes"] > 0
    assert mem["peak_step"] >= mem["persistent_bytes"] + mem["forward_delta"]
    others = [_adamw_block(shape, "fp32") for _ in range(2)]  # alive meanwhile: not counted
    assert t.memory() == mem and others
    # above persistent, the step holds the forward's tensors at one time and every fp32 gradient
    # (4 B/param) at another (backward frees activations as it makes gradients)
    n = sum(p.numel() for p in t.model.parameters())
    assert mem["peak_step"] - mem["persistent_bytes"] >= max(mem["forward_delta"], 4 * n)
