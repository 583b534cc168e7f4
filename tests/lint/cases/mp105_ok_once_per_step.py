import torch


def train(encoder, decoder, loader, enc_opt, dec_opt):
    scaler = torch.amp.GradScaler("cuda")
    for x in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = decoder(encoder(x)).mean()
        scaler.scale(loss).backward()
        for opt in (enc_opt, dec_opt):
            scaler.step(opt)
        scaler.update()


def two_scalers(G, D, loader, g_opt, d_opt):
    g_scaler = torch.amp.GradScaler("cuda")
    d_scaler = torch.amp.GradScaler("cuda")
    for real in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            d_loss = D(real).mean()
        d_scaler.scale(d_loss).backward()
        d_scaler.step(d_opt)
        d_scaler.update()
        with torch.autocast("cuda", dtype=torch.float16):
            g_loss = -D(G.sample()).mean()
        g_scaler.scale(g_loss).backward()
        g_scaler.step(g_opt)
        g_scaler.update()


def branches(model, loader, opt, scaler):
    for x in loader:
        loss = model(x)
        scaler.scale(loss).backward()
        if not torch.isfinite(loss):
            scaler.update(2.0**10)
            continue
        scaler.step(opt)
        scaler.update()
