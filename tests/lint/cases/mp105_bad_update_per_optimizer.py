import torch

scaler = torch.amp.GradScaler("cuda")
optimizers = [torch.optim.Adam(m.parameters()) for m in models]
for batch in loader:
    with torch.autocast("cuda", dtype=torch.float16):
        loss = sum(m(batch) for m in models)
    scaler.scale(loss).backward()
    for optimizer in optimizers:
        scaler.step(optimizer)
        scaler.update()  # expect: MP105
        optimizer.zero_grad()
