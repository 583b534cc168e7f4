"""A recipe under ``DistributedDataParallel``: which gradients cross the wire, in which dtype.

- fp32 and the -mixed recipes keep fp32 parameters, so their gradients are fp32 and DDP's own
  all-reduce averages them in fp32 (no hook). ``DDP(compress="bf16" | "fp16")`` registers a hook
  that casts each bucket to that dtype for the all-reduce and back (``compress_hook``). torch's
  ``bf16_compress_hook`` refuses gloo ("requires CUDA 11+ and NCCL 2.10+") although gloo reduces
  bf16 fine, and its ``fp16_compress_hook`` is the same cast-divide-reduce-copy: one hook here does
  both dtypes on both backends.
- 16-bit storage recipes (``bf16-true``...) compute 16-bit gradients; averaging them in 16 bits
  would round every partial sum. DDP is told to communicate nothing (``local_only_hook``), and the
  step averages the fp32 master gradients instead, after the 16-bit ones are folded into them
  (``Parallel.reduce_master_grads``).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


# (the hooks carry no annotations: DDP checks them, and these would be strings here)
def local_only_hook(state, bucket):  # noqa: ANN001, ANN201
    """A DDP comm hook that communicates nothing: the bucket's gradients stay this rank's own."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def compress_hook(dtype: torch.dtype) -> Any:
    """A DDP comm hook that all-reduces each bucket in ``dtype`` (divided by the world size first, as
    DDP divides) and writes the average back into the fp32 bucket."""

    def hook(group, bucket):  # noqa: ANN001, ANN202
        group = group if group is not None else dist.group.WORLD
        buffer = bucket.buffer()
        small = buffer.to(dtype).div_(dist.get_world_size(group))
        fut = dist.all_reduce(small, group=group, async_op=True).get_future()

        def back(f):  # noqa: ANN001, ANN202
            buffer.copy_(f.value()[0])
            return buffer

        return fut.then(back)

    hook.__name__ = f"{str(dtype).removeprefix('torch.')}_compress_hook"
    return hook


def wrap(mp: Any, model: nn.Module, cfg: Any) -> tuple[nn.Module, nn.Module]:
    """Prepare ``model`` for the recipe ``mp`` (a ``mixprec.seam.Local``) describes and wrap it in DDP;
    returns (the wrapper, the module). DDP broadcasts buffers from rank 0 at each forward unless
    ``DDP(broadcast_buffers=False)``: the one place that is set."""
    from torch.nn.parallel import DistributedDataParallel

    local = mp.apply(model)
    kwargs: dict[str, Any] = {
        "process_group": cfg.process_group,
        "find_unused_parameters": cfg.find_unused_parameters,
        "gradient_as_bucket_view": cfg.gradient_as_bucket_view,
    }
    if not cfg.broadcast_buffers:  # (torch 2.13 renamed it forward_sync_buffers and warns on the old name)
        new_name = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
        kwargs["forward_sync_buffers" if new_name else "broadcast_buffers"] = False
    if cfg.bucket_cap_mb is not None:
        kwargs["bucket_cap_mb"] = cfg.bucket_cap_mb
    if mp.device.type == "cuda":
        kwargs["device_ids"] = [mp.device.index if mp.device.index is not None else torch.cuda.current_device()]
    fp8 = mp.fp8_state()
    if fp8 is not None:  # fp8 scaling state: reduced over the ranks by mixprec.fp8.dist, never broadcast from rank 0
        ignored = [*getattr(local, "_ddp_params_and_buffers_to_ignore", ()), *fp8.buffer_names()]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(local, ignored)
    wrapped = DistributedDataParallel(local, **kwargs)
    if mp.masters is not None:
        wrapped.register_comm_hook(None, local_only_hook)
    elif cfg.compress is not None:
        wrapped.register_comm_hook(cfg.process_group, compress_hook(cfg.wire_dtype))
    return wrapped, local
