import torch


def train(encoder, decoder, loader, enc_opt, dec_opt):
    scaler = torch.amp.GradScaler("cuda")
    for x in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = decoder(encoder(x)).mean()
        scaler.scale(loss).backward()
        scaler.step(enc_opt)
        scaler.update()
        scaler.step(dec_opt)
        scaler.update()  # expect: MP105
        enc_opt.zero_grad()
        dec_opt.zero_grad()
