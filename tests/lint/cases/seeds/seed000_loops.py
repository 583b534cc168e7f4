# The training loops of seed 000 ("Mixed precision training"), retyped. They are correct and
# must lint clean.
import torch, torch.nn as nn


# bf16 — the simplest, no scaler needed
def train_bf16(model, dataloader, opt, epochs=1):
    for _ in range(epochs):
        for x, y in dataloader:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()  # OUTSIDE autocast
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()


# fp16 — requires a GradScaler, and the order is critical
def train_fp16(model, dataloader, opt, epochs=1):
    scaler = torch.amp.GradScaler("cuda")
    for _ in range(epochs):
        for x, y in dataloader:
            with torch.autocast("cuda", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()  # 1-2: scale and go backwards
            scaler.unscale_(opt)  # 3: MUST come before the clipping
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)  # 4: skips the step at inf/NaN
            scaler.update()  # 5: adjusts the scale factor


def my_sensitive_loss(logits, y):
    return -(torch.log(torch.softmax(logits, -1)) * y).sum() / (y.sum() + 1e-6)


def keep_sensitive_block_fp32(model, x, y):
    # Keep a sensitive block in fp32
    with torch.autocast("cuda", dtype=torch.bfloat16):
        h = model.backbone(x)
        with torch.autocast("cuda", enabled=False):  # off for just this
            logits = model.head(h.float())
            loss = my_sensitive_loss(logits, y)
    return loss


# Compare the curves instead of trusting that it works
def compare_precision(build_model, dataloader, steps=200):
    curves = {}
    for name, dtype in (("fp32", None), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        torch.manual_seed(0)
        m = build_model()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
        scaler = torch.amp.GradScaler("cuda", enabled=(dtype is torch.float16))
        losses = []
        for i, (x, y) in enumerate(dataloader):
            if i >= steps:
                break
            with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
                loss = nn.functional.cross_entropy(m(x), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt); scaler.update()
            losses.append(float(loss))
        curves[name] = losses
    return curves


# Detect NaN early instead of a hundred steps later
def nan_guard(model):
    def hook(name):
        def f(m, i, o):
            t = o[0] if isinstance(o, tuple) else o
            if torch.is_tensor(t) and not torch.isfinite(t).all():
                raise RuntimeError(f"non-finite values in {name}")
        return f
    for name, m in model.named_modules():
        m.register_forward_hook(hook(name))
