# The step is split between a helper and the loop body; the clip is in the loop.
import torch
import torch.amp as amp


def backward_scaled(scaler, loss):
    scaler.scale(loss).backward()


def main(model, loader, opt):
    scaler = amp.GradScaler("cuda")
    for x, y in loader:
        with amp.autocast("cuda", dtype=torch.float16):
            loss = model(x, y)
        backward_scaled(scaler, loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # expect: MP101
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
