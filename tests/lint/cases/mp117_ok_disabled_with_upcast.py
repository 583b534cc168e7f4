# Disabled regions that upcast first, call the project's own losses, or read only fp32 inputs.
import torch
import torch.nn.functional as F


def discriminator_loss(real, fake):
    loss = 0
    for dr, dg in zip(real, fake):
        loss += torch.mean((1 - dr.float()) ** 2) + torch.mean(dg.float() ** 2)
    return loss


def step(net_g, net_d, batch, target):
    with torch.autocast("cuda", dtype=torch.float16):
        y_hat = net_g(batch.x)
        d_real, d_fake = net_d(batch.wave), net_d(y_hat)
        with torch.autocast("cuda", enabled=False):
            loss_mel = F.l1_loss(y_hat.float(), target.float())
            loss_disc = discriminator_loss(d_real, d_fake)
        with torch.autocast("cuda", enabled=False):
            out = y_hat.float()
            weights = torch.exp(out)
        with torch.autocast("cuda", enabled=False):
            prior = torch.exp(batch.log_prior)  # an input, never 16-bit here
    return loss_mel + loss_disc + weights.mean() + prior.mean()
