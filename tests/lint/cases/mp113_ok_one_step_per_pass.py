import torch


def train(model, optimizer, loader, use_amp, scaler=None):
    for x, y in loader:
        optimizer.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16, enabled=use_amp):
            loss = model(x, y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()


def train_flags(model, optimizer, loader, use_amp):
    scaler = torch.amp.GradScaler("cuda", enabled=use_amp)
    for x, y in loader:
        optimizer.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16, enabled=use_amp):
            loss = model(x, y)
        if use_amp:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        if not use_amp:
            loss.backward()
            optimizer.step()


def two_phases(model, optimizer, warmup_loader, loader):
    scaler = torch.amp.GradScaler("cuda")
    for x, y in warmup_loader:  # fp32 warm-up: a loop of its own
        model(x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x, y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()


def two_optimizers(model, head, opt_body, opt_head, loader):
    scaler = torch.amp.GradScaler("cuda")
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = head(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt_body)
        scaler.step(opt_head)
        scaler.update()


def scaled_then_plain_phase(model, optimizer, x, y, aux):
    scaler = torch.amp.GradScaler("cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(x, y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    model.aux_loss(aux).backward()  # a second gradient, stepped on its own
    optimizer.step()
