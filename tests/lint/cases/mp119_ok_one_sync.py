# All gradients checked at once, one sync; checks kept as tensors; loops that check no gradient.
import torch


def grads_finite(params):
    flags = [torch.isfinite(p.grad).all() for p in params if p.grad is not None]
    return bool(torch.stack(flags).all())


def collect(params):
    bad = []
    for p in params:
        bad.append(torch.isnan(p.grad).any())
    return torch.stack(bad).any()


def inputs_ok(batches):
    for x in batches:
        if not torch.isfinite(x).all():
            return False
    return True
