import torch


def optimizer_step(optimizer):
    optimizer.step()
    optimizer.zero_grad()


def train_bf16(model, loader, optimizer):
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        optimizer_step(optimizer)


def train_region_off(model, loader, optimizer):
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, y)
            with torch.autocast("cuda", enabled=False):
                loss.float().backward()
                optimizer.step()
