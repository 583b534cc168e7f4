# Casting inputs, an inference-only model, and a 16-bit model whose optimizer holds fp32 masters.
import torch

x = batch.half()
model = Net().cuda().half().eval()
with torch.no_grad():
    y = model(x)

student = Net().to(torch.float16)
masters = [p.detach().clone().float().requires_grad_() for p in student.parameters()]
opt = torch.optim.SGD(masters, lr=0.1)

teacher = Net()
teacher_opt = torch.optim.SGD(teacher.parameters(), lr=0.1)
features = teacher.encoder(x).to(torch.float16)
