import torch
import torch.cuda.amp as cuda_amp
from torch.cpu.amp import autocast as cpu_autocast  # expect: MP201

scaler = torch.cuda.amp.GradScaler(init_scale=1024)  # expect: MP201
for x, y in loader:
    with cuda_amp.autocast(dtype=torch.float16):  # expect: MP201
        loss = model(x, y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()

with cpu_autocast():
    preds = model(x)


class Square(torch.autograd.Function):
    @staticmethod
    @torch.cuda.amp.custom_fwd(cast_inputs=torch.float32)  # expect: MP201
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    @torch.cuda.amp.custom_bwd  # expect: MP201
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad
