# Trainer shapes from well-known libraries (written anew), all correct: a callable scaler
# wrapper, a trainer whose scaler comes in as an argument, and one that branches on grad scaling.
import torch
from torch import nn


class NativeScaler:
    state_dict_key = "amp_scaler"

    def __init__(self, device="cuda"):
        self._scaler = torch.amp.GradScaler(device)

    def __call__(self, loss, optimizer, clip_grad=None, parameters=None, create_graph=False, need_update=True):
        self._scaler.scale(loss).backward(create_graph=create_graph)
        if need_update:
            if clip_grad is not None:
                self._scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(parameters, clip_grad)
            self._scaler.step(optimizer)
            self._scaler.update()

    def state_dict(self):
        return self._scaler.state_dict()


class AMPTrainer:
    def __init__(self, model, data_loader, optimizer, grad_scaler=None, precision=torch.float16):
        self.model, self.data_loader, self.optimizer = model, data_loader, optimizer
        if grad_scaler is None:
            grad_scaler = torch.amp.GradScaler("cuda")
        self.grad_scaler = grad_scaler
        self.precision = precision

    def run_step(self, data):
        with torch.autocast("cuda", dtype=self.precision):
            loss_dict = self.model(data)
            losses = sum(loss_dict.values())
        self.optimizer.zero_grad()
        self.grad_scaler.scale(losses).backward()
        self.grad_scaler.step(self.optimizer)
        self.grad_scaler.update()

    def state_dict(self):
        return {"optimizer": self.optimizer.state_dict(), "grad_scaler": self.grad_scaler.state_dict()}


class Trainer:
    def __init__(self, model, optimizer, fp16):
        self.model, self.optimizer = model, optimizer
        self.do_grad_scaling = fp16
        self.scaler = torch.amp.GradScaler("cuda", enabled=fp16)

    def training_step(self, inputs):
        with torch.autocast("cuda", dtype=torch.float16, enabled=self.do_grad_scaling):
            loss = self.model(**inputs).loss
        if self.do_grad_scaling:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()
        return loss.detach()

    def train(self, loader, max_grad_norm):
        for inputs in loader:
            self.training_step(inputs)
            if self.do_grad_scaling:
                self.scaler.unscale_(self.optimizer)
            nn.utils.clip_grad_norm_(self.model.parameters(), max_grad_norm)
            if self.do_grad_scaling:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
            self.optimizer.zero_grad()
