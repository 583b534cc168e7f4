# A scaler stored on self, the deprecated import spelling, and the clip in another method.
import torch
from torch.cuda.amp import GradScaler, autocast  # expect: MP201


class Trainer:
    def __init__(self, model, lr):
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        self.scaler = GradScaler()

    def clip(self):
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)

    def train_step(self, batch):
        with autocast():
            loss = self.model(**batch).loss
        self.scaler.scale(loss).backward()
        self.clip()  # expect: MP101
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()
