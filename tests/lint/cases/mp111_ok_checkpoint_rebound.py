# Near misses of the rebound checkpoint: what reaches torch.save is not a dict the rule can see
# whole, or the dict may gain the scaler's state before it is saved.
import torch


def train(model, optimizer, loader, path, resume, hooks):
    scaler = torch.amp.GradScaler("cuda")
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x, y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    ckpt = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    if resume:
        ckpt = torch.load(path)  # on this path the loaded checkpoint is what is saved
    torch.save(ckpt, path)

    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    hooks.on_save(state)  # handed to code that may add the scaler's state
    torch.save(state, path)

    merged = {**extra_state(), "model": model.state_dict(), "optimizer": optimizer.state_dict()}
    torch.save(merged, path)  # merged with a dict the rule cannot see

    ckpt = {"model": model.state_dict()}  # the earlier full dict does not reach this save
    torch.save(ckpt, path)

    for ckpt in pending:
        torch.save(ckpt, path)  # a loop target
