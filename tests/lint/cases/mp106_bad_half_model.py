import torch
from torch import optim

model = Net().cuda().half()  # expect: MP106
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

decoder = Decoder()
decoder.to(torch.bfloat16)  # expect: MP106
dec_opt = optim.SGD([{"params": decoder.parameters(), "lr": 0.01}])
