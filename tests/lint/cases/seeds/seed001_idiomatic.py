# Seed 001: the idiomatic autocast + GradScaler loop, one loop for bf16 and fp16 (the scaler is
# a no-op when disabled). Correct: must lint clean.
import torch

use_bf16 = torch.cuda.is_bf16_supported()  # Ampere and newer
amp_dtype = torch.bfloat16 if use_bf16 else torch.float16
# GradScaler is a transparent no-op when disabled, so one loop serves both.
scaler = torch.amp.GradScaler("cuda", enabled=not use_bf16)

for x, y in loader:
    with torch.autocast("cuda", dtype=amp_dtype):
        pred = model(x)  # matmuls in 16-bit per the op policy
        loss = loss_fn(pred, y)  # reductions autocast keeps in fp32
    scaler.scale(loss).backward()

    scaler.unscale_(opt)  # expose true grads BEFORE clipping
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)

    scaler.step(opt)  # skips the step if inf/NaN was found
    scaler.update()  # backoff on overflow, growth after 2000
    opt.zero_grad(set_to_none=True)
