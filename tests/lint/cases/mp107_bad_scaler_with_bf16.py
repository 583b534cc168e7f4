import torch

bf16 = torch.bfloat16
scaler = torch.amp.GradScaler("cuda")


def train(model, loader, opt):
    for x, y in loader:
        with torch.autocast("cuda", dtype=bf16):
            loss = model(x, y)
        scaler.scale(loss).backward()  # expect: MP107
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
