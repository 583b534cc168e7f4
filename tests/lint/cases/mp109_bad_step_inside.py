import torch


def train(model, loader, opt):
    scaler = torch.amp.GradScaler("cuda")
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x, y)
            scaler.scale(loss).backward()  # expect: MP102
            scaler.step(opt)  # expect: MP109
            scaler.update()


def optimizer_step(optimizer):
    optimizer.step()
    optimizer.zero_grad()


def train_bf16(model, loader, optimizer):
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            optimizer_step(optimizer)  # expect: MP109
