"""MP107 and MP108 when the dtype comes from a flag or a config (issue 31, item 2)."""

from __future__ import annotations

import textwrap

from mixprec.lint import lint_source


def found(source: str, *codes: str):
    return [(f.line, f.code, f.message) for f in lint_source(textwrap.dedent(source)) if f.code in codes]


def test_a_scaler_enabled_by_the_flag_that_turns_on_a_bf16_autocast_is_reported():
    source = """
    import torch

    def train(model, loader, opt, args):
        scaler = torch.amp.GradScaler("cuda", enabled=args.amp)
        for x, y in loader:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.amp):
                loss = model(x, y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    """
    (hit,) = found(source, "MP107")
    assert hit[0] == 9 and "same switch as the bf16 autocast" in hit[2]


def test_a_scaler_on_whatever_a_run_time_dtype_is_reported_with_the_fix():
    source = """
    import torch

    def train(model, loader, opt, use_amp, use_bf16):
        scaler = torch.amp.GradScaler("cuda") if use_amp else None
        for x, y in loader:
            with torch.autocast("cuda", dtype=torch.bfloat16 if use_bf16 else torch.float16, enabled=use_amp):
                loss = model(x, y)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
    """
    (hit,) = found(source, "MP107", "MP108")
    assert hit[:2] == (10, "MP107")
    assert "whatever the autocast dtype" in hit[2] and "enabled=(" in hit[2] and "== torch.float16" in hit[2]


def test_a_dtype_set_in_two_branches_and_a_scaler_switched_on_another_flag_is_reported():
    source = """
    import torch

    amp_dtype = torch.float16
    if args.amp_dtype == "bfloat16":
        amp_dtype = torch.bfloat16
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp)
    for x, y in loader:
        with torch.autocast("cuda", dtype=amp_dtype):
            loss = model(x, y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    """
    assert [h[:2] for h in found(source, "MP107")] == [(11, "MP107")]


def test_a_scaler_enabled_only_for_fp16_is_clean():
    # nanoGPT's way: the scaler's switch reads the dtype choice
    source = """
    import torch
    from contextlib import nullcontext

    dtype = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    ctx = nullcontext() if device_type == "cpu" else torch.amp.autocast(device_type=device_type, dtype=ptdtype)
    scaler = torch.cuda.amp.GradScaler(enabled=(dtype == "float16"))
    for x, y in loader:
        with ctx:
            loss = model(x, y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    amp_dtype = torch.float16
    if args.bf16:
        amp_dtype = torch.bfloat16
    scaler2 = torch.amp.GradScaler("cuda", enabled=not args.bf16)
    for x, y in loader:
        with torch.autocast("cuda", dtype=amp_dtype):
            loss = model(x, y)
        scaler2.scale(loss).backward()
        scaler2.step(opt)
        scaler2.update()
    """
    assert found(source, "MP107", "MP108") == []


def test_an_fp16_choice_with_no_scaler_anywhere_is_reported():
    source = """
    import torch

    dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16

    def train(model, loader, opt):
        for x, y in loader:
            with torch.autocast("cuda", dtype=dtype):
                loss = model(x, y)
            loss.backward()
            opt.step()
    """
    (hit,) = found(source, "MP108")
    assert hit[0] == 8 and "when dtype is float16" in hit[2]


def test_a_bf16_or_fp32_choice_with_no_scaler_is_clean():
    source = """
    import torch

    dtype = torch.bfloat16 if args.bf16 else torch.float32

    def train(model, loader, opt):
        for x, y in loader:
            with torch.autocast("cuda", dtype=dtype):
                loss = model(x, y)
            loss.backward()
            opt.step()
    """
    assert found(source, "MP107", "MP108") == []


def test_a_scaler_on_the_autocasts_own_switch_runs_whatever_dtype_another_flag_chose():
    # so-vits-svc: fp16_run turns both on; half_type picks bf16 or fp16 for the autocast
    source = """
    import torch

    def train(hps, net, loader, optim):
        scaler = torch.amp.GradScaler("cuda", enabled=hps.train.fp16_run)
        half_type = torch.bfloat16 if hps.train.half_type == "bf16" else torch.float16
        for x, y in loader:
            with torch.autocast("cuda", enabled=hps.train.fp16_run, dtype=half_type):
                loss = net(x, y)
            scaler.scale(loss).backward()
            scaler.step(optim)
            scaler.update()
    """
    assert [h[:2] for h in found(source, "MP107")] == [(10, "MP107")]
