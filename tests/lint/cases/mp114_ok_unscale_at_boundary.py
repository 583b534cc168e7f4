# Near misses of the accumulation trap: unscale_() once per optimizer step, at the boundary.
import torch


def pretrain(model, loader, optimizer, accum, clip):
    scaler = torch.amp.GradScaler("cuda")
    for idx, (img, mask) in enumerate(loader):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(img, mask) / accum
        scaler.scale(loss).backward()
        if (idx + 1) % accum == 0:
            if clip:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()


def skip_until_boundary(model, loader, optimizer, accum):
    scaler = torch.amp.GradScaler("cuda")
    for i, (x, y) in enumerate(loader):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x, y) / accum
        scaler.scale(loss).backward()
        if (i + 1) % accum != 0:
            continue
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()


def skip_then_check_again(model, loader, optimizer, accum):
    scaler = torch.amp.GradScaler("cuda")
    for i, (x, y) in enumerate(loader):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x, y) / accum
        scaler.scale(loss).backward()
        if i % accum != accum - 1:
            continue  # what follows runs only at the boundary, even before the `if` below
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if (i + 1) % accum == 0:
            scaler.step(optimizer)
            scaler.update()


def micro_steps(model, get_batch, optimizer, steps, micro):
    scaler = torch.amp.GradScaler("cuda")
    for step in range(steps):
        for micro_step in range(micro):
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(*get_batch()) / micro
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)


def disabled_scaler(model, loader, optimizer, accum):
    off = torch.amp.GradScaler("cuda", enabled=False)  # unscale_() of a disabled scaler does nothing
    for i, (x, y) in enumerate(loader):
        off.scale(model(x, y)).backward()
        off.unscale_(optimizer)
        if (i + 1) % accum == 0:
            off.step(optimizer)
            off.update()


def every_step(model, loader, optimizers):
    scaler = torch.amp.GradScaler("cuda")
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x, y)
        scaler.scale(loss).backward()
        for opt in optimizers:
            scaler.unscale_(opt)
            scaler.step(opt)
        if log_now:
            log(model)
        scaler.update()
