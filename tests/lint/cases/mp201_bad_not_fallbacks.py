# Near misses of the old-torch fallbacks: a test that is not about the torch version, an arm
# with no current twin, an except around other code. All deprecated, all reported.
import torch

scaler = torch.amp.GradScaler("cuda") if use_new_api else torch.cuda.amp.GradScaler()  # expect: MP201
legacy = torch.cuda.amp.GradScaler() if TORCH_2_4 else None  # expect: MP201
ctx = torch.cuda.amp.autocast() if device == "cuda" else torch.cpu.amp.autocast()  # expect: MP201, MP201

try:
    scaler = make_scaler()
except (AttributeError, TypeError):
    scaler = torch.cuda.amp.GradScaler()  # expect: MP201

if torch.__version__ >= "2.4":
    ctx = torch.autocast("cuda")
else:
    scaler = torch.cuda.amp.GradScaler()  # expect: MP201
