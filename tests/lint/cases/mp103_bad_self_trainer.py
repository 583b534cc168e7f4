import torch


class Runner:
    def __init__(self, net):
        self.net = net
        self.opt = torch.optim.Adam(net.parameters(), 1e-3)
        self.grad_scaler = torch.amp.GradScaler("cuda")

    def fit(self, batches):
        for batch in batches:
            with torch.autocast("cuda"):
                loss = self.net(batch)
            scaled = self.grad_scaler.scale(loss)
            scaled.backward()
            self.opt.step()  # expect: MP103
            self.grad_scaler.update()
            self.opt.zero_grad()
