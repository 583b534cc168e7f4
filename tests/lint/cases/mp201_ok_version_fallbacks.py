# Old-torch fallbacks: the deprecated API only where the current one may be missing. Not
# reported, and --fix leaves them alone (rewriting them would break the torch they exist for).
import torch
from packaging import version

from myproject.utils import TORCH_2_4

TORCH_GE_2_3 = version.parse(torch.__version__) >= version.parse("2.3")

scaler = torch.amp.GradScaler("cuda", enabled=amp) if TORCH_2_4 else torch.cuda.amp.GradScaler(enabled=amp)

if TORCH_GE_2_3:
    autocast = torch.autocast("cuda", dtype=torch.float16)
else:
    autocast = torch.cuda.amp.autocast(dtype=torch.float16)

if hasattr(torch.amp, "GradScaler"):
    probe = torch.amp.GradScaler("cuda")
else:
    probe = torch.cuda.amp.GradScaler()


class NativeScaler:
    def __init__(self, device="cuda"):
        try:
            self._scaler = torch.amp.GradScaler(device=device)
        except (AttributeError, TypeError):
            self._scaler = torch.cuda.amp.GradScaler()
