# autocast around the loss only: the forward above it runs in fp32, and the loss is never run in
# 16 bits, so the region changes nothing.
import torch
import torch.nn.functional as F

criterion = torch.nn.CrossEntropyLoss(label_smoothing=0.1)


def train(model, loader, optimizer):
    scaler = torch.amp.GradScaler("cuda")
    for images, labels in loader:
        output = model(images)
        with torch.autocast("cuda", dtype=torch.float16):  # expect: MP115
            loss = criterion(output, labels)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


class Trainer:
    def step(self, x, y):
        logits = self.net(x)
        with torch.autocast("cuda", dtype=torch.bfloat16):  # expect: MP115
            loss = F.cross_entropy(logits, y).mean()
        loss.backward()
        self.opt.step()
