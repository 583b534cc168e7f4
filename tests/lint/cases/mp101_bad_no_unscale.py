import torch
from torch.nn.utils import clip_grad_norm_


def train(model, loader, optimizer):
    scaler = torch.amp.GradScaler("cuda")
    for x, y in loader:
        optimizer.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        clip_grad_norm_(model.parameters(), max_norm=1.0)  # expect: MP101
        scaler.step(optimizer)
        scaler.update()
