"""Missed findings of the step walk (``flow``) that a probe of real scripts found: a plain torch
clip after Accelerate's fp16 backward (MP101), autocast entered through ``ExitStack`` or
``__enter__()`` (MP102), and an elif chain long enough to exhaust a recursive walk; each with
the near misses that must stay silent."""

from __future__ import annotations

import textwrap

import pytest

from mixprec.lint import lint_source


def found(source: str, code: str) -> list[tuple[int, str]]:
    return [(f.line, f.message) for f in lint_source(textwrap.dedent(source)) if f.code == code]


# --- MP101: Accelerate scales the loss under fp16; a plain torch clip does not unscale ---------

ACCELERATE = """
import torch
from accelerate import Accelerator

def main(model, optimizer, loader, args, ds):
    {make}
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for batch in loader:
        loss = model(**batch).loss
        accelerator.backward(loss)
        {before}
        {clip}(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
"""


def accelerate(make='accelerator = Accelerator(mixed_precision="fp16")', before="pass",
               clip="torch.nn.utils.clip_grad_norm_") -> str:
    return ACCELERATE.format(make=make, before=before, clip=clip)


def test_a_plain_clip_after_accelerates_fp16_backward_is_mp101():
    # /tmp/probe_lint/repro_10.py: accelerator.backward(loss) then torch.nn.utils.clip_grad_norm_
    ((line, message),) = found(accelerate(), "MP101")
    assert line == 12
    assert 'accelerator.backward() scales the loss under mixed_precision="fp16"' in message
    assert "use accelerator.clip_grad_norm_()" in message and "accelerator.unscale_gradients()" in message


def test_clip_grad_value_is_told_to_use_accelerates_clip_grad_value():
    ((_, message),) = found(accelerate(clip="torch.nn.utils.clip_grad_value_"), "MP101")
    assert "use accelerator.clip_grad_value_()" in message


@pytest.mark.parametrize(
    "make, when",
    [
        ('accelerator = Accelerator(mixed_precision="fp16" if args.fp16 else "no")', True),
        ('precision = "fp16"\n    accelerator = Accelerator(mixed_precision=precision)', False),
        ('accelerator = Accelerator(gradient_accumulation_steps=4, mixed_precision="fp16", cpu=False)', False),
    ],
)
def test_an_fp16_precision_in_sight_is_reported(make, when):
    ((_, message),) = found(accelerate(make=make), "MP101")
    assert ('when mixed_precision is "fp16"' in message) == when


def test_an_accelerator_on_self_or_named_otherwise_is_followed():
    source = """
    import torch
    from accelerate import Accelerator

    class Trainer:
        def __init__(self):
            self.accelerator = Accelerator(mixed_precision="fp16")

        def step(self, loss):
            self.accelerator.backward(loss)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)

    def main(model, loader):
        acc = Accelerator(mixed_precision="fp16")
        for batch in loader:
            acc.backward(model(batch))
            if acc.sync_gradients:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    """
    hits = found(source, "MP101")
    assert [line for line, _ in hits] == [11, 18]
    assert "use self.accelerator.clip_grad_norm_()" in hits[0][1] and "use acc.clip_grad_norm_()" in hits[1][1]


def test_a_helper_that_clips_reads_the_accelerator_the_file_builds():
    source = """
    import torch
    from accelerate import Accelerator

    def step(accelerator, model, loss):
        accelerator.backward(loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)

    def main(model, loader):
        accelerator = Accelerator(mixed_precision="{precision}")
        for batch in loader:
            step(accelerator, model, model(batch))
    """
    assert [line for line, _ in found(source.format(precision="fp16"), "MP101")] == [7]
    assert found(source.format(precision="bf16"), "MP101") == []


@pytest.mark.parametrize(
    "make",
    [
        'accelerator = Accelerator(mixed_precision="bf16")',  # no GradScaler: nothing to unscale
        'accelerator = Accelerator(mixed_precision="no")',
        "accelerator = Accelerator()",  # `accelerate config` / the environment decides: out of sight
        "accelerator = Accelerator(mixed_precision=args.mixed_precision)",  # a flag: out of sight
        'accelerator = Accelerator(mixed_precision="fp16", cpu=True)',  # no scaler on the CPU
        'accelerator = Accelerator(mixed_precision="fp16", deepspeed_plugin=ds)',  # DeepSpeed scales and clips itself
        'accelerator = Accelerator(mixed_precision="fp16", fsdp_plugin=ds)',
        'accelerator = Accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(enabled=args.amp)])',
        'accelerator = Accelerator(**args.accelerate)',
    ],
)
def test_no_scaler_in_sight_is_silent(make):
    assert found(accelerate(make=make), "MP101") == []


@pytest.mark.parametrize(
    "before, clip",
    [
        ("accelerator.unscale_gradients()", "torch.nn.utils.clip_grad_norm_"),  # unscaled first: correct
        ("accelerator.unscale_gradients(optimizer=optimizer)", "torch.nn.utils.clip_grad_norm_"),
        ("accelerator.scaler.unscale_(optimizer)", "torch.nn.utils.clip_grad_norm_"),
        ("pass", "accelerator.clip_grad_norm_"),  # Accelerate's own clip unscales
        ("pass", "accelerator.clip_grad_value_"),
    ],
)
def test_an_unscaled_or_accelerate_clip_is_silent(before, clip):
    assert found(accelerate(before=before, clip=clip), "MP101") == []


# --- MP102: autocast entered by a call, not a ``with`` -------------------------------------------

ENTERED = """
import torch
from contextlib import ExitStack

def train(model, opt, x):
    scaler = torch.amp.GradScaler("cuda")
{body}
    scaler.step(opt)
    scaler.update()
"""


def entered(body: str) -> list[int]:
    return [line for line, _ in found(ENTERED.format(body=textwrap.indent(textwrap.dedent(body), "    ")), "MP102")]


@pytest.mark.parametrize(
    "body, line",
    [
        (  # /tmp/probe_lint/repro_11.py
            """\
            with ExitStack() as stack:
                stack.enter_context(torch.autocast("cuda"))
                loss = model(x)
                scaler.scale(loss).backward()
            """, 10),
        (
            """\
            ctx = torch.autocast("cuda")
            ctx.__enter__()
            loss = model(x)
            scaler.scale(loss).backward()
            ctx.__exit__(None, None, None)
            """, 10),
        (
            """\
            stack = ExitStack()
            stack.enter_context(torch.no_grad())
            stack.enter_context(torch.autocast("cuda", dtype=torch.float16))
            loss = model(x)
            scaler.scale(loss).backward()
            stack.close()
            """, 11),
    ],
)
def test_autocast_entered_by_a_call_is_a_region_like_with(body, line):
    assert entered(body) == [line]


@pytest.mark.parametrize(
    "body",
    [
        """\
        with ExitStack() as stack:
            stack.enter_context(torch.autocast("cuda"))
            loss = model(x)
        scaler.scale(loss).backward()
        """,
        """\
        ctx = torch.autocast("cuda")
        ctx.__enter__()
        loss = model(x)
        ctx.__exit__(None, None, None)
        scaler.scale(loss).backward()
        """,
        """\
        stack = ExitStack()
        stack.enter_context(torch.autocast("cuda"))
        loss = model(x)
        stack.close()
        scaler.scale(loss).backward()
        """,
        """\
        with ExitStack() as stack:
            stack.enter_context(torch.autocast("cuda", enabled=False))
            stack.enter_context(torch.no_grad())
            loss = model(x)
            scaler.scale(loss).backward()
        """,
        """\
        try:
            ctx = torch.autocast("cuda")
            ctx.__enter__()
            loss = model(x)
        finally:
            ctx.__exit__(None, None, None)
        scaler.scale(loss).backward()
        """,
    ],
)
def test_a_backward_after_the_region_or_in_none_is_silent(body):
    assert entered(body) == []


# --- depth: an elif chain is walked in a loop ----------------------------------------------------

# The walk used to give up near 900 branches (MP000, exit status 3). Python 3.11's parser itself
# gives up near 3,000 (fewer the deeper the caller's stack): MP000 "too deeply nested for Python's
# parser", so a 5,000-branch chain cannot reach the walk at all.
BRANCHES = 2_000


def _deep(trap: str, at: int) -> str:
    lines = [
        "import torch", "", "def train(model, opt, loader, mode):", "    scaler = torch.amp.GradScaler('cuda')",
        "    for x in loader:", "        with torch.autocast('cuda'):", "            loss = model(x)",
        "        scaler.scale(loss).backward()", "        if mode == 0:", "            pass",
    ]
    for i in range(1, BRANCHES):
        lines += [f"        elif mode == {i}:", "            " + (trap if i == at else f"y = {i}")]
    lines += ["        scaler.step(opt)", "        scaler.update()"]
    return "\n".join(lines) + "\n"


def test_a_trap_deep_in_a_long_elif_chain_is_reported():
    at = BRANCHES - 5
    ((line, message),) = found(_deep("torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)", at), "MP101")
    assert line == 10 + 2 * at and "no scaler.unscale_()" in message
    assert [f.code for f in lint_source(_deep("y = 0", at))] == []


def test_arms_of_a_long_elif_chain_stay_exclusive():
    # the unscale_ in one arm and the clip in another never run in one pass: still MP101
    source = _deep("scaler.unscale_(opt)", 7).replace(
        f"elif mode == {BRANCHES - 1}:\n            y = {BRANCHES - 1}",
        f"elif mode == {BRANCHES - 1}:\n            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)",
    )
    assert [line for line, _ in found(source, "MP101")] == [10 + 2 * (BRANCHES - 1)]
    silent = _deep("scaler.unscale_(opt)\n            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)", 1500)
    assert found(silent, "MP101") == []


def test_a_long_elif_chain_at_module_level_is_walked():
    lines = ["import torch", "scaler = torch.amp.GradScaler('cuda')", "if mode == 0:", "    pass"]
    lines += [f"elif mode == {i}:\n    y = {i}" for i in range(1, BRANCHES)]
    lines += ["else:", "    with torch.autocast('cuda'):", "        loss = model(x)", "        scaler.scale(loss).backward()"]
    assert [f.code for f in lint_source("\n".join(lines) + "\n") if f.code == "MP102"] == ["MP102"]
