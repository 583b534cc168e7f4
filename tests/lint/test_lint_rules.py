"""Behaviour of the rules on small scripts: the names people use, and where the rules stay silent."""

from __future__ import annotations

import textwrap

import pytest

from mixprec.lint import lint_source


def codes(source: str, only: str | None = None) -> list[tuple[int, str]]:
    found = [(f.line, f.code) for f in lint_source(textwrap.dedent(source))]
    return [x for x in found if only is None or x[1] == only]


FP16_LOOP_WITHOUT_UNSCALE = """
{imports}
scaler = {scaler}
for x, y in loader:
    with {autocast}:
        loss = model(x, y)
    scaler.scale(loss).backward()
    {clip}(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
"""


@pytest.mark.parametrize(
    "imports, scaler, autocast, clip",
    [
        ("import torch", 'torch.amp.GradScaler("cuda")', 'torch.autocast("cuda")', "torch.nn.utils.clip_grad_norm_"),
        ("import torch as t", 't.amp.GradScaler("cuda")', 't.amp.autocast("cuda")', "t.nn.utils.clip_grad_norm_"),
        ("import torch.amp as amp\nimport torch", 'amp.GradScaler("cuda")', 'amp.autocast("cuda")', "torch.nn.utils.clip_grad_norm_"),
        (
            "from torch.amp import GradScaler as GS\nfrom torch import autocast as ac\nfrom torch.nn.utils import clip_grad_norm_ as clip",
            'GS("cuda")',
            'ac("cuda", dtype=torch.float16)',
            "clip",
        ),
        ("import torch\nfrom torch import nn", "torch.cuda.amp.GradScaler()", "torch.cuda.amp.autocast()", "nn.utils.clip_grad_norm_"),
        ("import torch\nimport mixprec", 'mixprec.GradScaler("cuda")', 'torch.autocast("cuda")', "torch.nn.utils.clip_grad_norm_"),
    ],
    ids=["torch", "alias", "module-alias", "from-import-as", "deprecated", "mixprec"],
)
def test_clip_before_unscale_is_found_whatever_the_import_spelling(imports, scaler, autocast, clip):
    source = FP16_LOOP_WITHOUT_UNSCALE.format(imports=imports, scaler=scaler, autocast=autocast, clip=clip)
    clip_line = source.splitlines().index(f"    {clip}(model.parameters(), 1.0)") + 1
    assert codes(source, "MP101") == [(clip_line, "MP101")]


def test_an_unrelated_name_called_clip_grad_norm_is_not_a_clip():
    source = """
    import torch
    from mylib import clip_grad_norm_
    scaler = torch.amp.GradScaler("cuda")
    scaler.scale(loss).backward()
    clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    """
    assert codes(source) == []


def test_backward_in_autocast_is_reported_at_the_call_of_a_helper_that_runs_it():
    source = """
    import torch

    def backward(loss):
        loss.backward()

    def train(model, x, opt):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x)
            backward(loss)
        opt.step()
    """
    assert codes(source) == [(10, "MP102")]


def test_a_finding_inside_a_helper_is_reported_once_in_the_helper_not_at_each_call():
    source = """
    import torch

    def step(model, x, opt, scaler):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x)
            scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    def train(model, loader, opt, scaler):
        for x in loader:
            step(model, x, opt, scaler)

    if __name__ == "__main__":
        train(model, loader, opt, torch.amp.GradScaler("cuda"))
    """
    assert codes(source) == [(7, "MP102")]


def test_recursive_helpers_do_not_loop_forever():
    source = """
    import torch

    def a(n, scaler):
        if n:
            b(n - 1, scaler)
        scaler.update()

    def b(n, scaler):
        a(n, scaler)
    """
    assert codes(source) == []


def test_autocast_with_a_runtime_dtype_gets_no_dtype_rules():
    source = """
    import torch
    scaler = torch.amp.GradScaler("cuda")
    with torch.autocast("cuda", dtype=cfg.dtype):
        loss = model(x)
    loss.backward()
    opt.step()
    """
    assert codes(source) == []


def test_dtype_bound_once_to_a_name_is_resolved():
    source = """
    import torch
    AMP_DTYPE = torch.float16
    with torch.autocast("cuda", dtype=AMP_DTYPE):
        loss = model(x)
    loss.backward()
    opt.step()
    """
    assert codes(source) == [(4, "MP108")]


def test_backward_inside_autocast_with_runtime_enabled_is_still_reported():
    source = """
    import torch
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=use_amp):
        loss = model(x)
        loss.backward()
    """
    assert codes(source) == [(5, "MP102")]


def test_autocast_as_a_decorator_makes_the_body_an_autocast_region():
    source = """
    import torch

    @torch.autocast("cuda", dtype=torch.bfloat16)
    def train_step(model, x, opt):
        loss = model(x)
        loss.backward()
        opt.step()
    """
    assert codes(source) == [(7, "MP102"), (8, "MP109")]


def test_optimizer_found_by_construction_whatever_its_name():
    source = """
    import torch
    adam = torch.optim.Adam(model.parameters())
    scaler = torch.amp.GradScaler("cuda")
    scaler.scale(loss).backward()
    adam.step()
    """
    assert codes(source, "MP103") == [(6, "MP103")]


@pytest.mark.parametrize("receiver", ["scheduler", "lr_scheduler", "env", "ema", "optimizer_scheduler"])
def test_step_on_things_that_are_not_optimizers_is_not_a_bypass(receiver):
    source = f"""
    import torch
    scaler = torch.amp.GradScaler("cuda")
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    {receiver}.step()
    """
    # a scheduler stepped after scaler.step() is MP120's note (info), not a bypass
    assert [c for c in codes(source) if c[1] != "MP120"] == []


def test_exclusive_branches_are_not_two_updates():
    source = """
    import torch
    scaler = torch.amp.GradScaler("cuda")
    for x in loader:
        scaler.scale(model(x)).backward()
        scaler.step(opt)
        if reset:
            scaler.update(1024.0)
        else:
            scaler.update()
    """
    assert codes(source) == []


def test_a_scaler_handed_to_an_unknown_function_may_be_updated_there():
    source = """
    import torch
    scaler = torch.amp.GradScaler("cuda")
    for x in loader:
        scaler.scale(model(x)).backward()
        scaler.step(opt)
        callbacks.after_step(scaler=scaler)
    """
    assert codes(source) == []


def test_update_outside_the_loop_is_not_excused_by_an_unrelated_escape_outside_it():
    source = """
    import torch
    scaler = torch.amp.GradScaler("cuda")
    for x in loader:
        scaler.scale(model(x)).backward()
        scaler.step(opt)
    scaler.update()
    log(scaler)
    """
    assert codes(source) == [(6, "MP104")]


def test_scaled_loss_divided_for_accumulation_is_still_scaled():
    source = """
    import torch
    scaler = torch.amp.GradScaler("cuda")
    for i, x in enumerate(loader):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x)
        (scaler.scale(loss) / accum).backward()
        if i % accum == 0:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
    """
    assert codes(source) == []


def test_manual_loss_scaling_is_not_mistaken_for_a_missing_scaler():
    source = """
    import torch
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(x)
    (loss * 1024.0).backward()
    for p in model.parameters():
        p.grad.div_(1024.0)
    opt.step()
    """
    assert codes(source) == []


def test_half_model_in_one_function_and_optimizer_over_another_model_in_another_is_clean():
    source = """
    import torch

    def export(model):
        model.half()
        return model.state_dict()

    def train(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    """
    assert codes(source) == []


def test_half_model_stored_on_self_and_trained_in_another_method_is_found():
    source = """
    import torch

    class Trainer:
        def __init__(self, net):
            self.model = net.half()

        def configure(self):
            self.opt = torch.optim.Adam(self.model.parameters())
    """
    assert codes(source) == [(6, "MP106")]


def test_checkpoint_with_a_scaler_saved_separately_is_clean():
    source = """
    import torch
    scaler = torch.amp.GradScaler("cuda")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, "ckpt.pt")
    torch.save(scaler.state_dict(), "scaler.pt")
    """
    assert codes(source) == []


def test_checkpoint_of_a_function_that_cannot_see_the_scaler_is_not_reported():
    source = """
    import torch

    def train(model, opt, loader):
        scaler = torch.amp.GradScaler("cuda")
        for x in loader:
            scaler.scale(model(x)).backward()
            scaler.step(opt)
            scaler.update()

    def save(model, opt):
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, "ckpt.pt")
    """
    assert codes(source) == []


def test_sensitive_loss_method_called_through_self_is_found():
    source = """
    import torch

    class Module(torch.nn.Module):
        def contrastive_loss(self, a, b):
            return -torch.log(torch.exp(a @ b.T).diag() / torch.exp(a @ b.T).sum(1)).mean()

        def training_step(self, batch):
            # on CPU, exp and log are not on autocast's fp32 list: the loss runs in bf16
            with torch.autocast("cpu", dtype=torch.bfloat16):
                a, b = self.encode(batch)
                return self.contrastive_loss(a, b)
    """
    assert codes(source) == [(12, "MP110")]


def test_math_log_in_a_loss_is_not_tensor_math():
    source = """
    import math
    import torch

    def smoothed_loss(logits, y, k):
        return torch.nn.functional.cross_entropy(logits, y) * math.log(k)

    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = smoothed_loss(model(x), y, 10)
    """
    assert codes(source) == []


def test_file_that_does_not_parse_is_reported_as_mp000():
    (finding,) = lint_source("def f(:\n    pass\n", "broken.py")
    assert (finding.code, finding.line, finding.path) == ("MP000", 1, "broken.py")
    assert finding.message.startswith("syntax error")


def test_noqa_silences_only_the_named_codes_on_its_line():
    source = """
    import torch
    scaler = torch.amp.GradScaler("cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(x)
        scaler.scale(loss).backward()  # noqa: MP102
    scaler.step(opt)
    scaler.update()
    s2 = torch.cuda.amp.GradScaler()  # noqa
    """
    assert codes(source) == [(6, "MP107")]  # MP102 (line 6) and MP201 (line 9) silenced


def test_columns_count_characters_not_utf8_bytes():
    source = 'import torch\nnote = "é"; s = torch.cuda.amp.GradScaler()\n'
    (finding,) = lint_source(source)
    assert finding.col == source.splitlines()[1].index("torch") + 1


def test_helpers_are_followed_three_calls_deep():
    source = """
    import torch

    def clip(model):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)

    def level2(model):
        clip(model)

    def level1(model):
        level2(model)

    def train(model, opt, loss):
        scaler = torch.amp.GradScaler("cuda")
        scaler.scale(loss).backward()
        level1(model)
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
    """
    assert codes(source) == [(16, "MP101")]


def test_loop_that_branches_on_amp_at_each_stage_is_clean():
    source = """
    import torch
    scaler = torch.amp.GradScaler("cuda", enabled=use_amp)
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16, enabled=use_amp):
            loss = model(x, y)
        if use_amp:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
        else:
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if use_amp:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
    """
    assert codes(source) == []


def test_half_model_is_found_per_function_and_through_a_method_chain():
    source = """
    import torch

    def export(model):
        model.half()

    def train(model):
        model.cuda().half()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    """
    assert codes(source) == [(8, "MP106")]


def test_a_scaler_received_as_a_parameter_is_the_callers_to_update():
    # framework-style step: the runner that passes the scaler in calls update() after the step
    source = """
    import torch

    class Model(torch.nn.Module):
        def train_step(self, batch, optimizer, grad_scaler=None):
            loss = self.compute(batch)
            if grad_scaler is not None:
                grad_scaler.scale(loss).backward()
                grad_scaler.step(optimizer)
            else:
                loss.backward()
                optimizer.step()
            return loss
    """
    assert codes(source) == []


def test_a_scaler_the_file_owns_is_still_reported_when_never_updated():
    source = """
    import torch

    class Trainer:
        def __init__(self):
            self.scaler = torch.amp.GradScaler("cuda")

        def step(self, loss, opt):
            self.scaler.scale(loss).backward()
            self.scaler.step(opt)
    """
    assert codes(source, "MP104") == [(10, "MP104")]


def test_fp16_branch_and_fp32_backward_under_the_same_condition_are_not_one_step():
    # the fp16 path backpropagates through a helper (a scaler wrapper); the plain backward()
    # sits in the other arm of a second `if` on the same flag, so they never run together
    source = """
    import torch

    def train(model, loader, opt, loss_scaler, use_amp):
        for x, y in loader:
            if use_amp:
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = model(x, y)
            else:
                loss = model(x, y)
            if not use_amp:
                loss.backward()
                opt.step()
            else:
                loss_scaler(loss, opt)
    """
    assert codes(source) == []


@pytest.mark.parametrize(
    "between",
    ["use_amp = not use_amp", "use_amp = cfg.flag()", "pass"],
    ids=["flag-flipped", "flag-reassigned", "other-condition"],
)
def test_fp16_branch_and_plain_backward_on_different_conditions_are_still_reported(between):
    other = "use_fp32" if between == "pass" else "use_amp"
    source = f"""
    import torch

    def train(model, loader, opt, use_amp, use_fp32):
        for x, y in loader:
            if use_amp:
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = model(x, y)
            else:
                loss = model(x, y)
            {between}
            if {other}:
                loss.backward()
                opt.step()
    """
    assert codes(source, "MP108") == [(7, "MP108")]


NO_GRAD_EVAL = """
import torch

{decorator}
def train_then_evaluate(model, opt, loader, val_loader):
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    {context}
        for x, y in val_loader:
            with torch.autocast("cuda", dtype=torch.float16):
                val = model(x)
"""


@pytest.mark.parametrize("context, flagged", [
    ("with torch.no_grad():", False),
    ("with torch.inference_mode():", False),
    ("with torch.set_grad_enabled(False):", False),
    ("with torch.enable_grad():", True),
    ("with torch.set_grad_enabled(is_training):", True),  # decided at run time: no exemption
    ("with torch.inference_mode(False):", True),
    ("if True:", True),
])
def test_mp108_leaves_out_an_fp16_region_that_runs_without_gradients(context, flagged):
    # training in fp32 and evaluating under fp16 autocast: the evaluation feeds no backward()
    source = NO_GRAD_EVAL.format(decorator="", context=context)
    assert codes(source, "MP108") == ([(13, "MP108")] if flagged else [])


def test_mp108_no_grad_exemption_covers_decorated_helpers_and_one_line_contexts():
    source = """
    import torch

    @torch.no_grad()
    def evaluate(model, batch):
        with torch.autocast("cuda", dtype=torch.float16):
            return model(batch)

    def train(model, opt, loader, val):
        for x, y in loader:
            loss = model(x).sum()
            loss.backward()
            opt.step()
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
            model(val)
        return evaluate(model, val)
    """
    assert codes(source, "MP108") == []
    # an enable_grad inside the no_grad block turns gradients back on: reported again
    inner = source.replace("        with torch.no_grad(), torch.autocast(\"cuda\", dtype=torch.float16):\n            model(val)",
                           "        with torch.no_grad():\n            with torch.enable_grad():\n"
                           "                with torch.autocast(\"cuda\", dtype=torch.float16):\n                    model(val)")
    assert inner != source and codes(inner, "MP108") == [(16, "MP108")]


def test_a_scaler_named_object_stepped_without_an_optimizer_is_not_a_grad_scaler():
    # GradScaler.step takes the optimizer; ``self.lr_scaler.step()`` is a learning-rate schedule
    source = """
    class Trainer:
        def __init__(self, model, opt, sched):
            self.model, self.opt, self.lr_scaler = model, opt, sched

        def train_step(self, x, y):
            self.model(x, y).backward()
            self.opt.step()
            self.lr_scaler.step()
    """
    assert codes(source) == []
    stepped = source.replace("self.lr_scaler.step()", "self.grad_scaler.step(self.opt)")
    assert (9, "MP104") in codes(stepped)  # a scaler after all: stepped with an optimizer, never updated


def test_a_direct_step_after_unscale_is_reported_for_the_skip_it_bypasses():
    source = """
    import torch
    scaler = torch.amp.GradScaler("cuda")
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    opt.step()
    scaler.update()
    """
    (finding,) = lint_source(textwrap.dedent(source))
    assert (finding.code, finding.line) == ("MP103", 6)
    assert finding.message == "opt.step() called directly after scaler.unscale_(): an inf/NaN step is applied, not skipped; use scaler.step(opt)"
    plain = lint_source(textwrap.dedent(source.replace("    scaler.unscale_(opt)\n", "")))
    assert plain[0].message == "opt.step() called directly after scaler.scale(loss).backward(); use scaler.step(opt)"


def test_unscale_per_micro_batch_names_the_update_and_the_error():
    source = """
    import torch

    def train(model, loader, opt, accum):
        scaler = torch.amp.GradScaler("cuda")
        for i, x in enumerate(loader):
            scaler.scale(model(x)).backward()
            scaler.unscale_(opt)
            if (i + 1) % accum == 0:
                scaler.step(opt)
                scaler.update()
    """
    (finding,) = lint_source(textwrap.dedent(source))
    assert (finding.code, finding.line) == ("MP114", 8)
    assert finding.message == (
        "scaler.unscale_(opt) on every micro-batch, but scaler.update() runs only at the accumulation "
        "boundary (line 11): the second micro-batch raises RuntimeError"
    )
    # a test that does not change from one micro-batch to the next is no accumulation boundary
    configured = source.replace("if (i + 1) % accum == 0:", "if accum > 1:")
    assert codes(configured, "MP114") == []


def test_unscale_per_micro_batch_through_a_helper_is_reported_at_the_call():
    source = """
    import torch

    def clip(scaler, opt, model):
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)

    def train(model, loader, opt, accum):
        scaler = torch.amp.GradScaler("cuda")
        for i, x in enumerate(loader):
            scaler.scale(model(x)).backward()
            clip(scaler, opt, model)
            if (i + 1) % accum == 0:
                scaler.step(opt)
                scaler.update()
    """
    # the clip in the helper runs on every micro-batch too (MP118)
    assert codes(source) == [(12, "MP114"), (12, "MP118")]


def test_a_checkpoint_saved_twice_is_reported_once_and_each_dict_once():
    source = """
    import torch

    def train(model, opt, loader, last, best):
        scaler = torch.amp.GradScaler("cuda")
        for x in loader:
            scaler.scale(model(x)).backward()
            scaler.step(opt)
            scaler.update()
        ckpt = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        torch.save(ckpt, last)
        torch.save(ckpt, best)
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, best)
    """
    assert codes(source) == [(11, "MP111"), (13, "MP111")]
