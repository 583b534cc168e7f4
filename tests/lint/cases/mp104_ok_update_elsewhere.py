# update() happens in the caller's loop, in a helper, or in code the scaler is handed to.
import torch

scaler = torch.amp.GradScaler("cuda")


def train_step(model, x, y, opt):
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(x, y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    opt.zero_grad()


def finish():
    scaler.update()


def run(model, loader, opt):
    for x, y in loader:
        train_step(model, x, y, opt)
        finish()


def run_with_callback(model, loader, opt, callbacks):
    other = torch.amp.GradScaler("cuda")
    for x, y in loader:
        other.scale(model(x, y)).backward()
        other.step(opt)
        callbacks.on_step_end(other)
