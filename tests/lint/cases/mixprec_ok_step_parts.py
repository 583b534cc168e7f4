# mixprec's step run in its public parts (as a framework integration does) and mp.step beside it:
# mp.unscale_() is one part of MixedPrecision's step, not a GradScaler's, so no MP104 for mp.step().
import torch
import mixprec

mp = mixprec.MixedPrecision("fp16-mixed", "cpu")
model = mp.prepare(torch.nn.Linear(4, 4))
opt = torch.optim.SGD(mp.parameters(model), lr=0.1)
for x in range(3):
    with mp.autocast():
        loss = model(torch.ones(2, 4)).sum()
    mp.step(loss, opt)


def parts(mp, opt, loss):
    mp.scaler.scale(loss).backward()
    mp.after_backward(opt)
    mp.unscale_(opt)
    mp.clip_grad_norm_(opt, 1.0)
    mp.optimizer_step(opt)
