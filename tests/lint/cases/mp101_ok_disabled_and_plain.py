# A literally disabled scaler is a no-op, and a plain backward is not scaled: clipping is right.
import torch


def train_no_amp(model, loader, opt):
    scaler = torch.amp.GradScaler("cuda", enabled=False)
    for x, y in loader:
        loss = model(x, y)
        scaler.scale(loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()


def train_bf16(model, loader, opt):
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
