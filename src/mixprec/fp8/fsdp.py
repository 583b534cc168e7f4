"""fp8 all-gather under FSDP2: an fp8 layer's sharded weight crosses the wire as fp8 bits, 1 byte per element.

``prepare(model, parallel=FSDP(fp8_all_gather=True))`` (torchao's ``enable_fsdp_float8_all_gather``).
Without it, FSDP2 all-gathers each fp8 layer's fp32 weight (4 bytes per element) and the layer casts
the gathered weight to fp8. With it, each rank casts its own shard before the all-gather, with the
scale of the whole weight: the amax of every shard, all-reduced (MAX) over the shard group, then
the current-scaling formula (``casts.current_scale``). Since the cast is elementwise, the gathered
bits are exactly those the layer would have made from the gathered fp32 weight (bitwise: tests/fp8),
for a quarter of the bytes, plus one all-reduce of a scalar per layer.

FSDP2's all-gather extension (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` on the shard)
carries it: the sharded parameter's local tensor is an ``Fp8ShardWeight`` (an fp32 tensor to every
other op: the optimizer steps it as it is), and the gathered weight an ``Fp8GatheredWeight``, fp8
bits and their scale that ``Fp8Linear`` multiplies as they are (any other op on it sees the
dequantized fp32 values). Current tensorwise scaling only, as torchao: delayed scaling's amax
history and rowwise or MX scales would need the whole weight.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from mixprec.fp8.casts import FloatFormat, amax, current_scale, dequantize_raw, quantize_raw

#: ops on a shard that FSDP2 uses to move it around: their results stay shards
_STRUCTURAL = {torch.ops.aten.empty_like.default, torch.ops.aten.new_zeros.default, torch.ops.aten.slice.Tensor,
               torch.ops.aten.copy_.default, torch.ops.aten.view.default, torch.ops.aten.as_strided.default,
               torch.ops.aten._to_copy.default, torch.ops.aten._pin_memory.default, torch.ops.aten.split.Tensor,
               torch.ops.aten.clone.default, torch.ops.aten.alias.default}
#: ops on the gathered weight that keep it fp8 bits with their scale (views)
_VIEWS = {torch.ops.aten.detach.default, torch.ops.aten.alias.default, torch.ops.aten.as_strided.default,
          torch.ops.aten.view.default, torch.ops.aten.t.default, torch.ops.aten.transpose.int}


def problem(spec: Any) -> str | None:
    """Why ``FSDP(fp8_all_gather=True)`` cannot apply to an fp8 recipe with ``spec`` (None when it can)."""
    if spec is None:
        return "FSDP(fp8_all_gather=True) gathers fp8 layers' weights as fp8: it needs an fp8 recipe (fp8-current)"
    if spec.scaling != "current" or spec.granularity != "tensorwise":
        return (f"FSDP(fp8_all_gather=True) needs current tensorwise scaling (fp8-current, as torchao's); this recipe "
                f"scales {spec.scaling} {spec.granularity}: a delayed history, rowwise or MX scales would need the "
                "whole weight on every rank. Drop fp8_all_gather, or use fp8-current")
    return None


class Fp8ShardWeight(torch.Tensor):
    """An fp8 layer's fp32 weight (a shard of it, once FSDP2 has sharded it) that all-gathers as fp8."""

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, fmt: FloatFormat, pow2: bool) -> "Fp8ShardWeight":
        return torch.Tensor._make_wrapper_subclass(cls, tensor.size(), strides=tensor.stride(),
                                                   storage_offset=tensor.storage_offset(), dtype=tensor.dtype,
                                                   layout=tensor.layout, device=tensor.device,
                                                   requires_grad=tensor.requires_grad)

    def __init__(self, tensor: torch.Tensor, fmt: FloatFormat, pow2: bool) -> None:
        self._tensor, self._fmt, self._pow2 = tensor, fmt, pow2

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        held = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, Fp8ShardWeight)][0]
        args, kwargs = pytree.tree_map_only(Fp8ShardWeight, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func is torch.ops.aten.detach.default or func in _STRUCTURAL:
            return pytree.tree_map_only(torch.Tensor, lambda t: Fp8ShardWeight(t, held._fmt, held._pow2), out)
        return out

    def __tensor_flatten__(self) -> tuple[list[str], dict[str, Any]]:
        return ["_tensor"], {"fmt": self._fmt, "pow2": self._pow2}

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], meta: dict[str, Any], size: Any, stride: Any) -> Any:
        return Fp8ShardWeight(inner["_tensor"], meta["fmt"], meta["pow2"])

    def __repr__(self) -> str:
        return f"Fp8ShardWeight({self._tensor}, all-gathered as {self._fmt.name})"

    def __reduce_ex__(self, protocol: Any) -> Any:  # saved as the plain fp32 tensor it is: checkpoints stay portable
        return self._tensor.__reduce_ex__(protocol)

    def fsdp_pre_all_gather(self, mesh: Any, outer_size: Any, outer_stride: Any, module: nn.Module,
                            mp_policy: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
        """This shard as fp8 bits, with the whole weight's scale (its amax all-reduced over ``mesh``)."""
        local = self._tensor
        a = amax(local) if local.numel() else torch.zeros((), device=local.device)
        dist.all_reduce(a, op=dist.ReduceOp.MAX, group=mesh.get_group())
        s = current_scale(a, self._fmt, self._pow2)
        return (quantize_raw(local, s, self._fmt),), (s,)

    def fsdp_post_all_gather(self, outputs: tuple[torch.Tensor, ...], metadata: Any, param_dtype: torch.dtype, *,
                             out: torch.Tensor | None = None) -> Any:
        (bits,), (s,) = outputs, metadata
        if out is not None:  # a later all-gather, into the same bits: the scale is this one's
            out._scale = s  # type: ignore[attr-defined]
            return None
        return Fp8GatheredWeight(bits, s, self._tensor.dtype), (bits,)


class Fp8GatheredWeight(torch.Tensor):
    """The all-gathered weight: fp8 bits and their scale, an fp32 tensor to autograd (its gradient is
    fp32). ``Fp8Linear`` multiplies the bits as they are; any other op sees ``bits / scale``."""

    @staticmethod
    def __new__(cls, bits: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> "Fp8GatheredWeight":
        return torch.Tensor._make_wrapper_subclass(cls, bits.size(), strides=bits.stride(),
                                                   storage_offset=bits.storage_offset(), dtype=dtype,
                                                   device=bits.device)

    def __init__(self, bits: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        self._data, self._scale = bits, scale

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _VIEWS and isinstance(args[0], Fp8GatheredWeight):
            w = args[0]
            return Fp8GatheredWeight(func(w._data, *args[1:], **(kwargs or {})), w._scale, w.dtype)
        args, kwargs = pytree.tree_map_only(
            Fp8GatheredWeight, lambda t: dequantize_raw(t._data, t._scale).to(t.dtype), (args, kwargs or {}))
        return func(*args, **kwargs)

    def __tensor_flatten__(self) -> tuple[list[str], dict[str, Any]]:
        return ["_data", "_scale"], {"dtype": self.dtype}

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], meta: dict[str, Any], size: Any, stride: Any) -> Any:
        return Fp8GatheredWeight(inner["_data"], inner["_scale"], meta["dtype"])

    def __repr__(self) -> str:
        return f"Fp8GatheredWeight(fp8 bits {tuple(self._data.shape)}, scale {float(self._scale):.4g})"


def enable(layers: list[tuple[str, Any]]) -> None:
    """Make each fp8 layer's weight an ``Fp8ShardWeight`` (before ``fully_shard``)."""
    for _, m in layers:
        w = m.weight
        cfg = m.fp8_config
        m.weight = nn.Parameter(Fp8ShardWeight(w.detach(), cfg.formats[1], cfg.pow2), requires_grad=w.requires_grad)


def gathered(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(bits, scale)`` of a gathered weight (contiguous, as ``nn.Linear`` lays it out), else None."""
    if isinstance(weight, Fp8GatheredWeight):
        return weight._data.contiguous(), weight._scale
    return None
