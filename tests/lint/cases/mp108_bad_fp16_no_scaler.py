import torch


def train(model, loader, opt):
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):  # expect: MP108
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()


def train_default_dtype(model, loader, opt):
    for x, y in loader:
        with torch.autocast("cuda"):  # expect: MP108
            loss = model(x, y)
        loss.backward()
        opt.step()
