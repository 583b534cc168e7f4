# unscale_() gives the gradients their true size, but optimizer.step() then applies a step with
# inf/NaN gradients that scaler.step() would have skipped.
import torch


def train(model, loader, optimizer):
    scaler = torch.amp.GradScaler("cuda")
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x, y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()  # expect: MP103
        scaler.update()
        optimizer.zero_grad()
