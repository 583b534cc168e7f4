import torch

try:  # torch < 2.3 fallback: the same name from two places is a shim, left alone
    from torch.amp import GradScaler
except ImportError:
    from torch.cuda.amp import GradScaler

scaler = GradScaler()
for x, y in loader:
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(x, y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


@torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)
def op(x):
    return x
