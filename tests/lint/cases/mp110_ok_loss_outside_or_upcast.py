import torch
import torch.nn.functional as F


def focal_loss(logits, target, gamma=2.0, eps=1e-8):
    p = torch.sigmoid(logits)
    return (-(1 - p) ** gamma * torch.log(p + eps) * target).mean()


def safe_focal_loss(logits, target, gamma=2.0, eps=1e-8):
    p = torch.sigmoid(logits.float())
    return (-(1 - p) ** gamma * torch.log(p + eps) * target).mean()


def mse_loss(pred, target):
    return ((pred - target) ** 2).mean()


def masked_loss(pred, target, mask):
    return (((pred - target) ** 2) * mask).sum() / mask.sum()


def train(model, loader, opt):
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
            loss = safe_focal_loss(logits, y) + mse_loss(logits, y) + F.cross_entropy(logits, y)
            loss = loss + masked_loss(logits, y, y > 0)
            with torch.autocast("cuda", enabled=False):
                loss = loss + focal_loss(logits.float(), y)
        loss = loss + focal_loss(logits.float(), y)
        loss.backward()
        opt.step()
