"""Scale-out on torch.distributed: the same recipes, steps and guarantees on many ranks.

    # torchrun --nproc_per_node 2 train.py     (CPU: gloo; CUDA: nccl)
    torch.distributed.init_process_group("gloo")
    mp = mixprec.MixedPrecision("bf16-mixed", device="cpu")
    model = mp.prepare(model, parallel="fsdp")          # or "ddp", or FSDP(...) / DDP(...)
    opt = torch.optim.AdamW(mp.parameters(model), lr=3e-4)
    ...  mp.step(loss, opt, max_grad_norm=1.0)             # the same loop
    mixprec.distributed.save_checkpoint(path, model=model, optimizer=opt, mp=mp)

What holds (docs/distributed.md says how): gradients are reduced in fp32 for every recipe unless
compression is asked for; one skip decision for all ranks (the loss scaler's inf/NaN flag is
MAX-all-reduced before any rank steps); clipping by the norm over every rank's gradients; the
loss scale and every counter identical on all ranks; checkpoints through
torch.distributed.checkpoint that resume bit for bit.

- ``config``: ``DDP`` and ``FSDP``, the options of ``prepare(parallel=...)``.
- ``prepare``: the checks on every rank, the one agreement between ranks, then the wrapping.
- ``ddp``: DistributedDataParallel and its comm hooks; ``fsdp``: ``fully_shard`` per group.
- ``runtime``: ``Parallel``, what the step asks of torch.distributed (``mixprec.seam.Strategy``).
- ``alignment``: the ranks kept in step when a step raises on one of them (``DesyncError``).
- ``checkpoint``: ``save_checkpoint`` / ``load_checkpoint`` (DCP).

``import mixprec.distributed`` loads only ``config`` (names resolve lazily).
"""

from __future__ import annotations

from mixprec._lazy import lazy_exports

from mixprec.distributed.config import DDP, FSDP, as_parallel

_LAZY = {
    "save_checkpoint": "mixprec.distributed.checkpoint",
    "load_checkpoint": "mixprec.distributed.checkpoint",
    "CheckpointError": "mixprec.distributed.checkpoint",
    "ParallelError": "mixprec.distributed.prepare",
    "DesyncError": "mixprec.distributed.alignment",
    "Parallel": "mixprec.distributed.runtime",
}

__all__ = sorted(["DDP", "FSDP", "as_parallel", *_LAZY])


__getattr__ = lazy_exports(__name__, _LAZY, globals())[0]
