# Seed 001 ("Mixed precision and loss scaling"): the hand-written fp16 loop with fp32 master
# weights and dynamic loss scaling, retyped. Correct: must lint clean.
import torch

torch.manual_seed(0)
dev = "cuda"

# fp32 master weights: the only copy the optimizer ever touches.
w1 = (torch.randn(4096, 1024, device=dev) * 0.02).requires_grad_()
w2 = (torch.randn(1024, 4096, device=dev) * 0.02).requires_grad_()
opt = torch.optim.AdamW([w1, w2], lr=3e-4)  # states in fp32 too

scale, good_steps = 2.0 ** 16, 0  # GradScaler's defaults
GROWTH_INTERVAL = 2000

for step in range(1000):
    x = torch.randn(32, 1024, device=dev)
    y = torch.randn(32, 1024, device=dev)

    # Forward in fp16 compute copies. The .half() casts are inside the
    # graph, so autograd casts gradients back to the fp32 leaves.
    h = torch.relu(x.half() @ w1.half().t())
    pred = h @ w2.half().t()
    loss = (pred.float() - y).pow(2).mean()  # loss math in fp32 (a reduction)

    (loss * scale).backward()  # every grad now carries factor S

    with torch.no_grad():
        grads = [w1.grad, w2.grad]
        if any(not g.isfinite().all() for g in grads):
            scale, good_steps = scale * 0.5, 0  # overflow: back off, skip step
        else:
            for g in grads:
                g.div_(scale)  # unscale in fp32, never in fp16
            opt.step()  # fp32 update on master weights
            good_steps += 1
            if good_steps == GROWTH_INTERVAL:
                scale, good_steps = scale * 2.0, 0  # probe a higher ceiling
    opt.zero_grad(set_to_none=True)
