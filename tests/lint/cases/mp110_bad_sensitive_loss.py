import torch
import torch.nn as nn
import torch.nn.functional as F


def focal_loss(logits, target, gamma=2.0, eps=1e-8):
    p = torch.sigmoid(logits)
    pt = torch.where(target == 1, p, 1 - p)
    return (-(1 - pt) ** gamma * torch.log(pt + eps)).mean()


class DiceLoss(nn.Module):
    def forward(self, logits, target):
        probs = logits.softmax(dim=1)
        inter = (probs * target).sum()
        return 1 - 2 * inter / (probs.sum() + target.sum() + 1e-6)


def cosine_embedding_loss(a, b, gamma):
    sim = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))
    return (1 - sim).pow(gamma).mean()


criterion = DiceLoss()


def train(model, loader, opt):
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
            loss = focal_loss(logits, y) + criterion(logits, y)  # expect: MP110, MP110
            loss = loss + cosine_embedding_loss(logits, y, 2.0)  # expect: MP110
        loss.backward()
        opt.step()
