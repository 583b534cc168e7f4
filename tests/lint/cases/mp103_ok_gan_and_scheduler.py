# D is trained with the scaler, G without it (plain fp32): G's direct step is right. Schedulers
# step directly too.
import torch


def train(G, D, loader, g_optimizer, d_optimizer, lr_scheduler):
    scaler = torch.amp.GradScaler("cuda")
    for real in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            d_loss = D(real).mean() - D(G.sample()).mean()
        scaler.scale(d_loss).backward()
        scaler.step(d_optimizer)
        scaler.update()
        d_optimizer.zero_grad()

        g_loss = -D(G.sample()).mean()
        g_loss.backward()
        g_optimizer.step()
        g_optimizer.zero_grad()
        lr_scheduler.step()
