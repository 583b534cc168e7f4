import torch


def train_cpu_default_is_bf16(model, loader, opt):
    for x, y in loader:
        with torch.autocast("cpu"):
            loss = model(x, y)
        loss.backward()
        opt.step()


@torch.no_grad()
def evaluate_fp16(model, loader):
    total = 0.0
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            total += model(x, y).item()
    return total


def train_accelerate(accelerator, model, loader, opt):
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x, y)
        accelerator.backward(loss)
        opt.step()


def compute_loss(model, x, y):
    with torch.autocast("cuda", dtype=torch.float16):
        return model(x, y)


def train_scaled_elsewhere(model, loader, opt, scaler):
    for x, y in loader:
        loss = compute_loss(model, x, y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
