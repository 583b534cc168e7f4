# Gradient accumulation in the nanoGPT shape: unscale_ and the clip only when stepping.
import torch

ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
ctx = torch.amp.autocast(device_type="cuda", dtype=ptdtype)
scaler = torch.amp.GradScaler("cuda", enabled=(dtype == "float16"))
optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4)

for it, (X, Y) in enumerate(batches):
    with ctx:
        logits, loss = model(X, Y)
        loss = loss / accumulation_steps
    scaler.scale(loss).backward()
    if (it + 1) % accumulation_steps == 0:
        if grad_clip != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
