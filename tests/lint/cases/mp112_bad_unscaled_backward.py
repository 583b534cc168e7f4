import torch


def train(model, loader, opt):
    scaler = torch.amp.GradScaler("cuda")
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x, y)
        loss.backward()  # expect: MP112
        scaler.step(opt)
        scaler.update()
