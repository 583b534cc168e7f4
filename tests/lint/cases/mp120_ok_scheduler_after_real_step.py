# The skip is checked; the scheduler steps per epoch; it schedules another optimizer.
import torch


def train(model, loader, optimizer, scheduler):
    scaler = torch.amp.GradScaler("cuda")
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x, y)
        scale_before = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if scaler.get_scale() >= scale_before:
            scheduler.step()


def train_epochs(model, loader, optimizer, epochs):
    scaler = torch.amp.GradScaler("cuda")
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=30)
    for epoch in range(epochs):
        for x, y in loader:
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(x, y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        scheduler.step()


def train_gan(G, D, loader, g_opt, d_opt):
    scaler = torch.amp.GradScaler("cuda")
    g_scheduler = torch.optim.lr_scheduler.LambdaLR(g_opt, lambda s: 1.0)
    for real in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            d_loss = D(real).mean()
        scaler.scale(d_loss).backward()
        scaler.step(d_opt)
        scaler.update()
        g_loss = -D(G.sample()).mean()
        g_loss.backward()
        g_opt.step()
        g_scheduler.step()
