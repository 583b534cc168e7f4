# Seed 003 ("The Promise and the Pain of FP16"): its AMP loops, retyped. The order is right,
# but they use the deprecated torch.cuda.amp imports: only MP201 (fixable) may be reported.
import torch
from torch.cuda.amp import autocast, GradScaler  # expect: MP201

model = MyModel().cuda()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
scaler = GradScaler(init_scale=2**16, growth_interval=100)
for batch in dataloader:
    optimizer.zero_grad()
    with autocast(dtype=torch.float16):
        output = model(batch["input"].cuda())
        loss = criterion(output, batch["target"].cuda())
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


# BF16 training — no scaler needed
def train_bf16(model, dataloader, optimizer, criterion):
    for batch in dataloader:
        optimizer.zero_grad()
        with autocast(dtype=torch.bfloat16):
            output = model(batch["input"].cuda())
            loss = criterion(output, batch["target"].cuda())
        loss.backward()
        optimizer.step()


class SafeLayerNorm(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.bias = torch.nn.Parameter(torch.zeros(dim))
        self.eps = 1e-5

    def forward(self, x):
        # Force FP32 for mean/variance computation
        x_float = x.float()
        mean = x_float.mean(-1, keepdim=True)
        var = x_float.var(-1, keepdim=True, unbiased=False)
        x_normed = (x_float - mean) / torch.sqrt(var + self.eps)
        return (x_normed * self.weight + self.bias).to(x.dtype)
