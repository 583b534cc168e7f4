import torch
from torch import amp


def step(model, x, y, opt, scaler):
    with amp.autocast("cuda", dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()  # expect: MP102
    scaler.step(opt)
    scaler.update()


def step_bf16(model, x, y, opt):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()  # expect: MP102
    opt.step()
