# A step function a framework calls once per batch (no loop in sight): the scheduler steps
# after scaler.step() whether or not it skipped.
import torch


class Solver:
    def __init__(self, model, optimizer, lr_scheduler):
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self.scaler = torch.amp.GradScaler("cuda")

    def run_step(self, batch):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = self.model(batch)
        loss = self.scaler.scale(loss)
        loss.backward()
        self.scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        if self.lr_scheduler:
            self.lr_scheduler.step()  # expect: MP120
        self.optimizer.zero_grad()
        return {"grad_scale": self.scaler.get_scale()}  # read for logging, after the scheduler
