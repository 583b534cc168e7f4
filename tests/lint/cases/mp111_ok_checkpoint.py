import torch


class Trainer:
    def __init__(self, model):
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters())
        self.scaler = torch.amp.GradScaler("cuda")

    def save(self, path):
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        state["scaler"] = self.scaler.state_dict()
        torch.save(state, path)

    def save_weights_only(self, path):
        torch.save({"model": self.model.state_dict()}, path)
