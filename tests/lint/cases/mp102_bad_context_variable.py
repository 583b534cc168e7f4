# The nanoGPT way to name the context: a variable that is autocast on GPU.
from contextlib import nullcontext

import torch

device_type = "cuda" if torch.cuda.is_available() else "cpu"
ctx = nullcontext() if device_type == "cpu" else torch.amp.autocast(device_type=device_type, dtype=torch.bfloat16)

for X, Y in batches:
    with ctx:
        logits, loss = model(X, Y)
        loss.backward()  # expect: MP102
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
