# Near misses of the indirect checkpoints: a helper that changes what it saves, a snapshot
# dataclass with a place for the scaler's state, a merge that names the scaler.
from dataclasses import asdict, dataclass

import torch


def save_checkpoint(state, path, extra):
    state.update(extra)  # may add the scaler's state: not a plain save helper
    torch.save(state, path)


def save_with_extras(state, path):
    torch.save({**state, **extras()}, path)  # not its argument as it came


@dataclass
class Snapshot:
    model_state: dict
    optimizer_state: dict
    scaler_state: dict | None = None  # filled in elsewhere


class Trainer:
    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer
        self.scaler = torch.amp.GradScaler("cuda")

    def step(self, x, y):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = self.model(x, y)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def save(self, path, extra):
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        save_checkpoint(state, path, extra)
        save_with_extras(state, path)
        torch.save({**state, "grad_scaler": extra["scaler"]}, path)

    def save_snapshot(self, path):
        snapshot = Snapshot(model_state=self.model.state_dict(), optimizer_state=self.optimizer.state_dict())
        torch.save(asdict(snapshot), path)
