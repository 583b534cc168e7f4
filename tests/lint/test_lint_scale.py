"""The linter's time grows linearly with a file's length, module-level code included.

A script that runs its training at module level (no functions) makes one scope of the whole
file; a rule that compares every event of a scope with every other, or a walk that carries
every name of the module through every statement, is quadratic there (a 50,000-line module
took more than 15 minutes). The module below is made of the blocks real scripts repeat:
a training loop with autocast and a GradScaler, a checkpoint, an evaluation under no_grad,
a try/except, a helper called at module level.
"""

from __future__ import annotations

import gc
import time

import pytest

from mixprec.lint import lint_source

_BLOCKS = (
    '''scaler{i} = torch.amp.GradScaler("cuda", enabled=use_amp)
for step{i}, (x, y) in enumerate(loader):
    with torch.autocast("cuda", dtype=torch.float16, enabled=use_amp):
        logits{i} = model(x)
        loss{i} = F.cross_entropy(logits{i}, y)
    scaler{i}.scale(loss{i} / accum).backward()
    if (step{i} + 1) % accum == 0:
        scaler{i}.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler{i}.step(opt)
        scaler{i}.update()
        opt.zero_grad(set_to_none=True)
''',
    '''ckpt{i} = {{"model": model.state_dict(), "optimizer": opt.state_dict(), "scaler": scaler{j}.state_dict()}}
if best_{j} < 0.5:
    ckpt{i}["best"] = best_{j}
torch.save(ckpt{i}, "ckpt{i}.pt")
''',
    '''with torch.no_grad():
    for x, y in val_loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            val{i} = model(x).float().mean()
        best_{i} = min(best_{j}, val{i}.item())
''',
    '''try:
    state{i} = torch.load("resume{i}.pt")
    model.load_state_dict(state{i}["model"])
except FileNotFoundError:
    state{i} = None
else:
    print("resumed", state{i}.keys())
''',
    '''def helper{i}(batch, opt):
    out = model(batch)
    out.mean().backward()
    opt.step()
    return out
result{i} = helper{i}(next(iter(loader)), opt)
lr{i} = cfg.lr * (0.5 ** ({i} % 7))
for group in opt.param_groups:
    group["lr"] = lr{i}
''',
)


def module_of(lines: int) -> str:
    """A module-level training script of about ``lines`` lines."""
    out = ["import torch", "import torch.nn.functional as F", "best_0 = 1.0", "scaler0 = None"]
    i = 0
    while len(out) < lines:
        i += 1
        out.extend(_BLOCKS[i % len(_BLOCKS)].format(i=i, j=max(i - 5 + (5 - i % 5) % 5, 0)).splitlines())
    return "\n".join(out) + "\n"


def _cpu_seconds(text: str) -> float:
    """CPU time of one lint (other processes on a shared machine do not count), with the
    garbage collector paused: its passes over the suite's leftovers are noise here."""
    gc.collect()
    gc.disable()
    try:
        start = time.process_time()
        lint_source(text)
        return time.process_time() - start
    finally:
        gc.enable()


def test_generated_module_parses_and_lints_clean():
    text = module_of(300)
    compile(text, "<generated>", "exec")
    assert [f.code for f in lint_source(text)] == []


def test_module_level_code_lints_in_linear_time():
    small, large = module_of(4_000), module_of(16_000)
    t_small = min(_cpu_seconds(small) for _ in range(2))  # the first run also warms the interpreter
    t_large = _cpu_seconds(large)
    # 4x the lines: about 4.5x the time when linear, 16x when quadratic (measured 14x before)
    assert t_large < 8 * t_small, (t_small, t_large)


@pytest.mark.slow
def test_a_50k_line_module_lints_in_seconds():
    text = module_of(50_000)
    assert _cpu_seconds(text) < 30  # measured about 7 s on M2; quadratic took over 15 minutes
