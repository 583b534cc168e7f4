import torch


class Trainer:
    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer
        self.scaler = torch.amp.GradScaler("cuda")

    def train(self, loader, out, every):
        for step, (x, y) in enumerate(loader):
            with torch.autocast("cuda", dtype=torch.float16):
                loss = self.model(x, y)
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            if step % every == 0:
                checkpoint = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
            else:
                checkpoint = self.full_state()  # another value it may hold: cannot tell which is saved
            torch.save(checkpoint, out)

    def export(self, parts, out):
        checkpoint = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        parts.append(checkpoint)
        for checkpoint in parts:  # bound by a loop too: what is saved is not that dict alone
            torch.save(checkpoint, out)
