# mixprec.GradScaler used out of order is still wrong.
import mixprec
import torch

scaler = mixprec.GradScaler("cuda")
for x, y in loader:
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(x, y)
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # expect: MP101
    opt.step()  # expect: MP103
