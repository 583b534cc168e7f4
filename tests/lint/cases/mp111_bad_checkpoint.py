import torch

scaler = torch.amp.GradScaler("cuda", enabled=(dtype == "float16"))


def save(model, optimizer, step, path):
    checkpoint = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "iter_num": step,
    }
    torch.save(checkpoint, path)  # expect: MP111


def save_inline(model, opt, path):
    torch.save(dict(model=model.state_dict(), opt=opt.state_dict()), path)  # expect: MP111


def train(model, loader, optimizer):
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x, y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
