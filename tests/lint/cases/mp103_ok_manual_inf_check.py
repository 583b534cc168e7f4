# A hand-written inf check decides the step: the scaler's own bookkeeping is bypassed on purpose.
import torch


def step(model, loss, optimizer, scaler):
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    grads_finite = all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)  # expect: MP119
    if grads_finite:
        optimizer.step()
    scaler.update()
