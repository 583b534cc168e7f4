# The checkpoint name is bound several times in one function: the loaded checkpoint of a resume
# branch, None to free memory, then the dict that is saved (and deleted after saving). The dict
# that reaches torch.save is what counts.
import torch


def train(model, optimizer, loader, epochs, weights, last, best, resume):
    scaler = torch.amp.GradScaler("cuda")
    start = 0
    ckpt = None
    if resume:
        ckpt = torch.load(weights, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        start = restore(ckpt, optimizer)  # handed on: the loaded dict, not the one saved below
        del ckpt
    for epoch in range(start, epochs):
        for x, y in loader:
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(x, y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        ckpt = {"epoch": epoch, "model": model.state_dict(), "optimizer": optimizer.state_dict()}
        torch.save(ckpt, last)  # expect: MP111
        if epoch == epochs - 1:
            torch.save(ckpt, best)  # the same dict again: reported once, at its first save
        del ckpt


checkpoint = None
model = build()
optimizer = torch.optim.AdamW(model.parameters())
scaler = torch.amp.GradScaler("cuda", enabled=use_fp16)
if init_from == "resume":
    checkpoint = torch.load(path)
    model.load_state_dict(checkpoint["model"])
checkpoint = None  # free up memory
while True:
    with torch.autocast("cuda", dtype=torch.float16, enabled=use_fp16):
        loss = model(*get_batch())
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    if step % interval == 0:
        checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
        torch.save(checkpoint, out)  # expect: MP111
