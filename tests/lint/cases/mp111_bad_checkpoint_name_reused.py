import torch


class Trainer:
    def __init__(self, model, optimizer, path):
        self.model, self.optimizer = model, optimizer
        self.scaler = torch.amp.GradScaler("cuda")
        checkpoint = torch.load(path)  # a resume, in another method: not what train() saves
        self.model.load_state_dict(checkpoint["model"])

    def train(self, loader, out, every):
        for step, (x, y) in enumerate(loader):
            with torch.autocast("cuda", dtype=torch.float16):
                loss = self.model(x, y)
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            if step % every == 0:
                checkpoint = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
                torch.save(checkpoint, out)  # expect: MP111
        checkpoint = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "step": step}
        torch.save(checkpoint, out)  # expect: MP111
