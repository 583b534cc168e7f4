# The shape of a YOLO-style train.py (written anew): `from torch.cuda import amp`, a scaler
# enabled by a flag, accumulation by a step counter, EMA, and a checkpoint without the scaler.
import torch
from torch.cuda import amp


def train(hyp, opt, device, model, optimizer, scheduler, ema, train_loader, compute_loss, epochs, last):
    half_precision = device.type != "cpu"
    scaler = amp.GradScaler(enabled=half_precision)  # expect: MP201
    last_opt_step = -1
    for epoch in range(epochs):
        optimizer.zero_grad()
        for i, (imgs, targets) in enumerate(train_loader):
            ni = i + len(train_loader) * epoch
            with amp.autocast(enabled=half_precision):  # expect: MP201
                pred = model(imgs)
                loss, loss_items = compute_loss(pred, targets.to(device))
            scaler.scale(loss).backward()
            if ni - last_opt_step >= opt.accumulate:
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
                if ema:
                    ema.update(model)
                last_opt_step = ni
        scheduler.step()
        ckpt = {
            "epoch": epoch,
            "model": model.state_dict(),
            "ema": ema.ema.state_dict(),
            "optimizer": optimizer.state_dict(),
        }
        torch.save(ckpt, last)  # expect: MP111
