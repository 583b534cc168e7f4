"""MP114 behind a guard on the data (issue 31, item 3)."""

from __future__ import annotations

import textwrap

import pytest

from mixprec.lint import lint_source

LOOP = """
import torch

def train(model, loader, opt, accum, min_size):
    scaler = torch.amp.GradScaler("cuda")
    for i, batch in enumerate(loader):
        {guard}
            continue
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(batch) / accum
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if (i + 1) % accum == 0:
            scaler.step(opt)
            scaler.update()
"""


@pytest.mark.parametrize("guard", ["if short_batch:", "if batch is None:", "if batch.size(0) < min_size:"])
def test_an_early_continue_on_the_data_still_leaves_unscale_on_every_other_micro_batch(guard):
    found = [(f.line, f.code) for f in lint_source(LOOP.format(guard=guard)) if f.code == "MP114"]
    assert found == [(12, "MP114")]


def test_an_early_continue_on_the_step_counter_leaves_unscale_to_the_boundary():
    source = textwrap.dedent("""
    import torch

    def train(model, loader, opt, accum):
        scaler = torch.amp.GradScaler("cuda")
        for i, batch in enumerate(loader):
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(batch) / accum
            scaler.scale(loss).backward()
            if (i + 1) % accum != 0:
                continue
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
    """)
    assert [f.code for f in lint_source(source)] == []


def test_gradients_zeroed_on_every_iteration_accumulate_nothing():
    # SlowFast: the step is skipped on some iterations (a freeze schedule), but zero_grad() runs
    # on every one: clipping or unscaling every iteration is right there
    source = textwrap.dedent("""
    import torch

    def train(model, loader, opt, scaler):
        for i, x in enumerate(loader):
            with torch.autocast("cuda", dtype=torch.float16):
                opt.zero_grad()
                loss = model(x)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            update_param = i > 100
            if update_param:
                scaler.step(opt)
            scaler.update()
    """)
    assert [f.code for f in lint_source(source)] == []
