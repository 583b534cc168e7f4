# mixprec's training step is correct by construction: nothing to report, even for a 16-bit model
# (mixprec keeps the fp32 masters) and a checkpoint of mixprec's own state.
import torch
import mixprec

model = Net().to(torch.bfloat16)
opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
mp = mixprec.MixedPrecision("fp16-mixed", device="cuda")
model = mp.prepare(model)
for x, y in loader:
    with mp.autocast():
        loss = loss_fn(model(x), y)
    mp.step(loss, opt)
torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "mp": mp.state_dict()}, "ckpt.pt")
