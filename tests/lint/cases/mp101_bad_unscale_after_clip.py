import torch
import torch.nn as nn

model = nn.Linear(8, 8).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler()

for x in loader:
    with torch.autocast(device_type="cuda"):
        loss = model(x).square().mean()
    scaler.scale(loss).backward()
    nn.utils.clip_grad_value_(model.parameters(), 0.5)  # expect: MP101
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
