import torch


def step(model, x, y, opt):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()


def step_disabled_inner(model, x, y, opt):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(x)
        with torch.autocast("cuda", enabled=False):
            loss = torch.nn.functional.mse_loss(out.float(), y)
            loss.backward()
            opt.step()


def step_amp_off(model, x, y, opt):
    with torch.autocast("cuda", enabled=False):
        loss = model(x, y)
        loss.backward()
        opt.step()
