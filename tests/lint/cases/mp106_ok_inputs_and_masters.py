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

# LoRA: the model is rebound to a wrapper whose trainable adapters are fp32.
base = AutoModelForCausalLM.from_pretrained("gpt2", torch_dtype=torch.bfloat16)
base = get_peft_model(base, lora_config)
lora_opt = torch.optim.AdamW(base.parameters(), lr=1e-4)

# An optimizer made for 16-bit weights (Kahan summation) is the fix, not the trap.
from optimi import AdamW

pure = Net().to(torch.bfloat16)
pure_opt = AdamW(pure.parameters(), lr=1e-4, kahan_sum=True)
