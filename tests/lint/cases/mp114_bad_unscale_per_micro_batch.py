# Gradient accumulation with unscale_() on every micro-batch: step() and update() run every
# `accum` micro-batches, so the second micro-batch's unscale_() raises RuntimeError.
import torch


def pretrain(model, loader, optimizer, scheduler, accum, clip):
    scaler = torch.amp.GradScaler("cuda")
    for idx, (img, mask) in enumerate(loader):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(img, mask)
        if accum > 1:
            loss = loss / accum
            scaler.scale(loss).backward()
            if clip:
                scaler.unscale_(optimizer)  # expect: MP114
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)  # expect: MP118
            if (idx + 1) % accum == 0:
                scaler.step(optimizer)
                optimizer.zero_grad()
                scaler.update()
                scheduler.step()  # expect: MP120
        else:  # no accumulation: unscale_, step and update on every batch, correct
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()


def distill(student, teacher, loader, optimizer, accumulate):
    scaler = torch.amp.GradScaler("cuda")
    last_opt_step = -1
    for i, (x, y) in enumerate(loader):
        with torch.no_grad():
            target = teacher(x)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = kd_loss(student(x), target, y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)  # expect: MP114
        grad_norm = torch.nn.utils.clip_grad_norm_(student.parameters(), 10.0)  # expect: MP118
        if i - last_opt_step >= accumulate:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            last_opt_step = i


def micro_steps(model, get_batch, optimizer, steps, micro):
    scaler = torch.amp.GradScaler("cuda")
    for step in range(steps):
        for micro_step in range(micro):
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(*get_batch()) / micro
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)  # expect: MP114
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
