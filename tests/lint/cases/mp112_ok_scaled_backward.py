import torch


def backward(loss):
    loss.backward()


def train(model, loader, opt):
    scaler = torch.amp.GradScaler("cuda")
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x, y)
        backward(scaler.scale(loss))
        scaler.step(opt)
        scaler.update()


def train_named(model, loader, opt, scaler):
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x, y)
        scaled_loss = scaler.scale(loss)
        scaled_loss.backward()
        scaler.step(opt)
        scaler.update()
