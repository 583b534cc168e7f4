import torch


def train(model, loader, optimizer, scheduler):
    scaler = torch.amp.GradScaler("cuda")
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x, y)
        scaler.scale(loss).backward()
        optimizer.step()  # expect: MP103
        scheduler.step()
        optimizer.zero_grad()
