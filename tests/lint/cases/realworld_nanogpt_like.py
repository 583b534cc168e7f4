# The shape of nanoGPT's train.py (written anew): one loop for every dtype, a scaler enabled only
# for fp16, micro-step accumulation, and a checkpoint that forgets the scaler.
import os
from contextlib import nullcontext

import torch

dtype = "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float16"
device_type = "cuda"
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
ctx = nullcontext() if device_type == "cpu" else torch.amp.autocast(device_type=device_type, dtype=ptdtype)

model = GPT(config)
model.to(device_type)
scaler = torch.cuda.amp.GradScaler(enabled=(dtype == "float16"))  # expect: MP201
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)

while True:
    if iter_num % eval_interval == 0:
        checkpoint = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "iter_num": iter_num,
        }
        torch.save(checkpoint, os.path.join(out_dir, "ckpt.pt"))  # expect: MP111
    for micro_step in range(gradient_accumulation_steps):
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
        X, Y = get_batch("train")
        scaler.scale(loss).backward()
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    iter_num += 1
    if iter_num > max_iters:
        break
