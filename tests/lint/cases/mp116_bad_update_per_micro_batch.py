# scaler.update() on every micro-batch while scaler.step() runs only at the accumulation
# boundary: the micro-batches in between have no inf checks, and update() raises AssertionError.
import torch


def train(model, loader, optimizer, accum):
    scaler = torch.amp.GradScaler("cuda")
    for i, (x, y) in enumerate(loader):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x, y) / accum
        scaler.scale(loss).backward()
        if (i + 1) % accum == 0:
            scaler.step(optimizer)
            optimizer.zero_grad()
        scaler.update()  # expect: MP116


def train_two_groups(model, loader, opt_backbone, opt_head, every):
    # each optimizer steps at its own boundary; update() runs on every iteration regardless
    scaler = torch.amp.GradScaler("cuda")
    for it, (x, y) in enumerate(loader):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x, y)
        scaler.scale(loss).backward()
        if it % every == 0:
            scaler.step(opt_backbone)
            opt_backbone.zero_grad()
        if it % 2 == 0:
            scaler.step(opt_head)
            opt_head.zero_grad()
        scaler.update()  # expect: MP116
