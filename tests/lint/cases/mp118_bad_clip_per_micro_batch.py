# Clipping every micro-batch's partial gradient sum while the optimizer steps every `accum`.
import torch


def train(model, loader, optimizer, accum):
    for i, (x, y) in enumerate(loader):
        loss = model(x, y) / accum
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # expect: MP118
        if (i + 1) % accum == 0:
            optimizer.step()
            optimizer.zero_grad()
