# A host sync per parameter tensor, every step.
import torch


def grads_finite(model):
    for p in model.parameters():
        if p.grad is not None and not torch.isfinite(p.grad).all():  # expect: MP119
            return False
    return True


def report_nans(model):
    for name, param in model.named_parameters():
        if torch.isnan(param.grad).any().item():  # expect: MP119
            print("NaN gradient in", name)


def check(optimizer):
    for group in optimizer.param_groups:
        for p in group["params"]:
            assert p.grad.isfinite().all(), "non-finite gradient"  # expect: MP119
