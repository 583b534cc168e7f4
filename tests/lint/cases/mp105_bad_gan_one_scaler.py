# One scaler shared by two networks: update() once per optimizer is once too many per step.
import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

scaler = ShardedGradScaler()
for source, target in loader:
    with torch.autocast("cuda", dtype=torch.float16):
        total_loss = seg_loss(model(source)) + adv_loss(D(model(target)))
    scaler.scale(total_loss).backward()
    scaler.step(optimizer)
    scaler.update()

    optimizer_D.zero_grad()
    with torch.autocast("cuda", dtype=torch.float16):
        D_loss = 0.5 * (bce(D(source)) + bce(D(target)))
    scaler.scale(D_loss).backward()
    scaler.step(optimizer_D)
    scaler.update()  # expect: MP105
