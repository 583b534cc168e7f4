# autocast(enabled=False) around fp32 work on tensors the enclosing autocast made 16-bit.
import torch
import torch.nn.functional as F


def generator_step(net_g, batch, scaler, optim_g):
    with torch.autocast("cuda", dtype=torch.float16):
        y_hat = net_g(batch.x)
        y_hat_mel = mel_spectrogram(y_hat)
        with torch.autocast("cuda", enabled=False):
            loss_mel = F.l1_loss(y_hat_mel, batch.mel) * 45  # expect: MP117
    scaler.scale(loss_mel).backward()
    scaler.step(optim_g)
    scaler.update()


def energy_weights(model, x):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        energy = model(x)
        with torch.autocast("cuda", enabled=False):
            weights = torch.exp(energy)  # expect: MP117
    return weights


def vits_step(net_g, net_d, batch, scaler, optim_g, half):
    # the mel of the generated audio is made in one region, the loss in another (RVC, VITS)
    with torch.autocast("cuda", enabled=half):
        y_hat = net_g(batch.x)
        y_mel = slice_segments(batch.mel)
        y_hat_mel = mel_spectrogram(y_hat.float()).half()
    with torch.autocast("cuda", enabled=half):
        scores = net_d(y_hat)
        with torch.autocast("cuda", enabled=False):
            loss_mel = F.l1_loss(y_mel, y_hat_mel) * 45  # expect: MP117
    scaler.scale(loss_mel + scores.mean()).backward()
    scaler.step(optim_g)
    scaler.update()
