# bf16 training has no scaler: a model + optimizer checkpoint is complete.
import torch


def train_and_save(model, loader, optimizer, path):
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        optimizer.step()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
