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


def distance_loss(a, b):
    return (a - b).pow(2).sum(-1).sqrt().mean()


criterion = DiceLoss()


def train_cpu(model, loader, opt):
    # CPU autocast's fp32 list has none of log, pow, norm: every loss above runs in bf16
    for x, y in loader:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
            loss = focal_loss(logits, y) + criterion(logits, y)  # expect: MP110, MP110
            loss = loss + cosine_embedding_loss(logits, y, 2.0)  # expect: MP110
        loss.backward()
        opt.step()


def train_cuda(model, loader, opt, scaler):
    # CUDA runs log, pow and the norms in fp32; sqrt stays fp16, and fp16 cannot hold eps=1e-8
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(x)
            loss = focal_loss(logits, y) + criterion(logits, y)  # expect: MP110
            loss = loss + cosine_embedding_loss(logits, y, 2.0) + distance_loss(logits, y)  # expect: MP110
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
