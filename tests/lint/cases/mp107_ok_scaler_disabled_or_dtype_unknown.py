import torch


def train(model, loader, opt, amp_dtype):
    scaler = torch.amp.GradScaler("cuda", enabled=amp_dtype == torch.float16)
    for x, y in loader:
        with torch.autocast("cuda", dtype=amp_dtype):
            loss = model(x, y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


def train_bf16_noop_scaler(model, loader, opt):
    scaler = torch.amp.GradScaler("cuda", enabled=False)
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
