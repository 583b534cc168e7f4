import torch
from torch import nn


def train_one_epoch(model, criterion, optimizer, loader, use_amp, clip=None, scaler=None):
    for image, target in loader:
        output = model(image)
        optimizer.zero_grad()
        if use_amp:
            with torch.autocast("cuda", dtype=torch.float16):
                loss = criterion(output, target)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss = criterion(output, target)
            loss.backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()  # expect: MP113


def train_gan_step(gen, disc, opt_d, batch):
    scaler = torch.amp.GradScaler("cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        loss = disc(gen(batch)).mean()
    scaler.scale(loss).backward()
    opt_d.step()  # expect: MP103, MP113
    scaler.step(opt_d)
    scaler.update()
