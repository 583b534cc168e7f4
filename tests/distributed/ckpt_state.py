"""What a checkpoint holds, as one digest (for the checkpoint fault tests): the full fp32 parameters
and optimizer state by parameter name, the loss scaler's state and mixprec's step counter. Computed
alike on N ranks (FSDP2 shards are gathered: a collective) and on one process after a load."""

from __future__ import annotations

import hashlib

import torch

from mixprec.tasks import charlm

TASK = charlm.make_task(batch_size=4, seq_len=16, d_model=32, n_layer=2, n_head=4)
RECIPE = "fp16-mixed"
SCALER = {"init_scale": 2.0**8, "growth_interval": 1}  # the scale moves at every step


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float().cpu()


def state_digest(mp, model, opt) -> str:
    names = {id(p): n.removeprefix("module.") for n, p in mp.named_parameters(model)}
    tensors = {f"param {names[id(p)]}": _full(p) for _, p in mp.named_parameters(model)}
    for p, state in opt.state.items():
        for key, value in state.items():
            if torch.is_tensor(value):
                tensors[f"opt {names[id(p)]} {key}"] = _full(value)
    h = hashlib.sha1()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    scaler = mp.scaler.state_dict()
    h.update(repr((scaler["scale"], scaler["_growth_tracker"], mp.state_dict()["steps"])).encode())
    return h.hexdigest()


def local_digest(mp, model, opt) -> str:
    """This rank's own tensors (FSDP2: its shards; no collective), optimizer state, scaler and steps."""
    def local(t):
        return (t.to_local() if hasattr(t, "to_local") else t).detach().float().cpu()
    h = hashlib.sha1()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(local(p).reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    for i, state in enumerate(opt.state.values()):
        for key, value in sorted(state.items()):
            h.update(f"{i} {key}".encode())
            if torch.is_tensor(value):
                h.update(local(value).reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    h.update(repr((mp.scaler.state_dict(), mp.state_dict()["steps"])).encode())
    return h.hexdigest()


def build(parallel=None, seed=0, d_ff=None):
    import mixprec

    torch.manual_seed(seed)
    mp = mixprec.MixedPrecision(RECIPE, "cpu", scaler=dict(SCALER))
    model = TASK.build_model()
    if d_ff is not None:  # another width of every block's MLP
        for block in model.blocks:
            block.fc, block.out = torch.nn.Linear(32, d_ff), torch.nn.Linear(d_ff, 32)
    model = mp.prepare(model, parallel=parallel) if parallel else mp.prepare(model)
    return mp, model, torch.optim.AdamW(mp.parameters(model), lr=1e-2)


def train(mp, model, opt, steps, start=0, rank=0, world=1):
    for s in range(start, start + steps):
        x, y = TASK.get_batch(s)
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        with mp.autocast():
            logits = model(x)
        mp.step(charlm.lm_loss(logits, y), opt)
