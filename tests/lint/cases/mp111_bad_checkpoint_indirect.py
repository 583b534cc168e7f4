# The checkpoint reaches torch.save through a save helper of this file, a merge of dicts the
# rule can see, or dataclasses.asdict() of a snapshot dataclass of this file.
import dataclasses
from dataclasses import asdict, dataclass

import torch


def save_checkpoint(state, path):
    torch.save(state, path)


def save_on_main(*args, **kwargs):
    if is_main_process():
        torch.save(*args, **kwargs)


@dataclass
class Snapshot:
    model_state: dict
    optimizer_state: dict
    finished_epoch: int


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

    def save(self, path, epoch):
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        save_checkpoint(state, path)  # expect: MP111
        save_on_main({**state, "epoch": epoch}, path)  # expect: MP111
        self._write(dict(state, epoch=epoch), path)  # expect: MP111

    def _write(self, payload, path):
        torch.save(payload, path)

    def save_snapshot(self, path, epoch):
        snapshot = Snapshot(
            model_state=self.model.state_dict(),
            optimizer_state=self.optimizer.state_dict(),
            finished_epoch=epoch,
        )
        snapshot = asdict(snapshot)
        torch.save(snapshot, path)  # expect: MP111

    def save_positional(self, path, epoch):
        torch.save(dataclasses.asdict(Snapshot(self.model.state_dict(), self.optimizer.state_dict(), epoch)), path)  # expect: MP111
