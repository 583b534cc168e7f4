import torch
from torch import optim

model = Net().cuda().half()  # expect: MP106
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

decoder = Decoder()
decoder.to(torch.bfloat16)  # expect: MP106
dec_opt = optim.SGD([{"params": decoder.parameters(), "lr": 0.01}])

llm = AutoModelForCausalLM.from_pretrained("gpt2", torch_dtype=torch.bfloat16)  # expect: MP106
llm_opt = torch.optim.AdamW(llm.parameters(), lr=1e-5)
