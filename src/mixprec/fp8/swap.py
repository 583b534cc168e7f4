"""Which matmul layers compute in fp8, the swap itself, and its undoing.

The candidates are every ``nn.Linear`` and every Hugging Face ``Conv1D`` (GPT-2's projections: a
matmul with a transposed weight, ``mixprec.fp8.conv1d``). The rules, in the order they are applied
(the first that matches decides; ``Decision.reason`` says which):

1. only ``nn.Linear`` or ``Conv1D`` itself: a subclass may not compute ``F.linear`` in its forward
   (``MultiheadAttention``'s ``out_proj`` never calls it), so it stays as it is;
2. a layer that is an fp32 island, or inside one, stays fp32 (``fp32_modules=``);
3. a glob of ``Fp8Spec.exclude`` on the qualified name keeps it bf16 (a glob that matches no
   candidate is refused: a typo would otherwise pass silently);
4. ``in_features`` and ``out_features`` must both be multiples of 16 (what fp8 GEMMs need; 32 for
   MXFP8 block scaling, whose blocks are 32 long);
5. with ``Fp8Spec.skip_first_last`` (the default), the model's first and last candidate (in
   ``model.named_modules()`` order) and an LM head (a layer named ``lm_head``, or whose weight is
   an embedding's) stay bf16: torchao's advice, as the first and last layers are the most sensitive;
6. the rest compute in fp8.

The swap is in place: an ``nn.Linear``'s class becomes ``Fp8Linear``, a ``Conv1D``'s an fp8
subclass of it; the parameters, hooks and state-dict keys stay (delayed scaling's state is in
non-persistent buffers). ``remove_fp8`` turns every fp8 layer back into the class it was.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any

import torch
from torch import nn

from mixprec.fp8 import conv1d
from mixprec.fp8.linear import Fp8Config, Fp8Linear, Fp8Matmul

MULTIPLE = 16
MX_MULTIPLE = 32  # MXFP8: every reduction axis cut into 32-element blocks
ISLAND = "an fp32 island"
INSIDE = "inside the fp32 island"
LM_HEAD = "the LM head (torchao keeps it in bf16)"
_BUFFERS = ("fp8_amax_history", "fp8_scale")
_ATTRS = ("fp8_config", "fp8_name", "fp8_observers", "fp8_original_class", "_fp8_weight_cache")


@dataclasses.dataclass(frozen=True)
class Decision:
    """One matmul layer and what the rules made of it: ``fp8`` True, or the ``reason`` it stays.
    ``kind``: "Linear" or "Conv1D"; ``lm_head``: it is the model's LM head (converted or not)."""

    name: str
    in_features: int
    out_features: int
    fp8: bool
    reason: str
    kind: str = "Linear"
    lm_head: bool = False

    @property
    def precision(self) -> str:
        """What the layer computes in: fp8, fp32 (an island) or bf16 (the recipe's autocast)."""
        return "fp8" if self.fp8 else "fp32" if self.reason.startswith((ISLAND, INSIDE)) else "bf16"


def _embedding_weights(model: nn.Module) -> set[int]:
    return {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}


def candidates(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every ``nn.Linear`` (subclasses included) and Hugging Face ``Conv1D`` of ``model``, in order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) or conv1d.is_conv1d(m)]


def _features(m: nn.Module) -> tuple[int, int]:
    return conv1d.features(m) if conv1d.is_conv1d(m) else (m.in_features, m.out_features)


def _plain(m: nn.Module) -> bool:
    return type(m) in (nn.Linear, Fp8Linear) or conv1d.is_conv1d(m)


def decide(model: nn.Module, spec: Any) -> list[Decision]:
    """Every candidate layer of ``model`` and the rule that decided it. Raises ValueError for an
    ``exclude`` glob that matches no candidate's name."""
    layers = candidates(model)
    unmatched = [p for p in spec.exclude if not any(fnmatch.fnmatchcase(n, p) for n, _ in layers)]
    if unmatched:
        names = [n for n, _ in layers]
        raise ValueError(f"fp8 exclude pattern(s) {unmatched} match no nn.Linear or Conv1D of {type(model).__name__}; "
                         f"they are globs on the layers' qualified names, which are {names[:8]}"
                         f"{' ...' if len(names) > 8 else ''} (e.g. 'blocks.0.*' for a whole block)")
    multiple, what = (MX_MULTIPLE, "MXFP8") if spec.granularity == "mx" else (MULTIPLE, "fp8")
    plain = [n for n, m in layers if _plain(m)]
    ends = {plain[0]: "first", plain[-1]: "last"} if plain else {}
    tied = _embedding_weights(model)
    islands = [n for n, m in model.named_modules() if n and getattr(m, "_mixprec_island", None) is not None]
    out = []
    for name, m in layers:
        fp8, reason = False, ""
        n_in, n_out = _features(m)
        head = name.rpartition(".")[2] == "lm_head" or id(m.weight) in tied
        kind = "Conv1D" if conv1d.is_conv1d(m) else "Linear"
        if not _plain(m):
            reason = f"{type(m).__name__} is a subclass of nn.Linear: its forward may not be F.linear"
        elif getattr(m, "_mixprec_island", None) is not None:
            reason = ISLAND
        elif _island_above(name, islands):
            reason = f"{INSIDE} {_island_above(name, islands)!r}"
        elif any(fnmatch.fnmatchcase(name, pat) for pat in spec.exclude):
            reason = f"excluded by {next(p for p in spec.exclude if fnmatch.fnmatchcase(name, p))!r}"
        elif n_in % multiple or n_out % multiple:
            reason = f"{n_in}x{n_out}: {what} GEMMs need both dims multiples of {multiple}"
        elif spec.skip_first_last and head:
            reason = LM_HEAD
        elif spec.skip_first_last and name in ends:
            reason = f"the {ends[name]} {'nn.Linear' if kind == 'Linear' else 'matmul (Conv1D)'} " \
                     "(torchao keeps the first and last layers in bf16)"
        else:
            fp8 = True
        out.append(Decision(name, n_in, n_out, fp8, reason, kind, head))
    return out


def _island_above(name: str, islands: list[str]) -> str | None:
    """The fp32 island that holds the layer ``name`` (an island computes in fp32: fp8 inside it is less)."""
    return next((i for i in islands if name.startswith(i + ".")), None)


def backend_for(spec: Any, device: torch.device) -> str:
    """The GEMM backend ``spec.gemm`` means on ``device``: fp8 GEMMs where the device has them
    (CUDA sm89+: Ada, Hopper and later), else the emulation. Raises when ``scaled_mm`` is asked of a
    GPU without fp8 GEMMs."""
    cuda = device.type == "cuda" and torch.cuda.is_available()
    if spec.granularity == "mx":  # block-scaled fp8 GEMMs: Blackwell's tensor cores (sm100+)
        has_mx = cuda and torch.cuda.get_device_capability(device) >= (10, 0)
        if spec.gemm == "scaled_mm" and not has_mx:
            where = torch.cuda.get_device_name(device) if cuda else f"the {device.type} device"
            raise RuntimeError(f"fp8 granularity='mx' with gemm='scaled_mm' needs block-scaled fp8 GEMMs (CUDA sm100+: "
                               f"Blackwell); {where} has none. Use gemm='emulate' (or 'auto').")
        return "scaled_mm" if has_mx and spec.gemm != "emulate" else "emulate"
    has_fp8 = cuda and torch.cuda.get_device_capability(device) >= (8, 9)
    if spec.gemm == "auto":
        return "scaled_mm" if has_fp8 else "emulate"
    if spec.gemm == "scaled_mm" and device.type == "cuda" and not has_fp8:
        raise RuntimeError(f"fp8 gemm='scaled_mm' needs fp8 GEMMs (CUDA sm89+: Ada, Hopper or later); "
                           f"{torch.cuda.get_device_name(device)} has none. Use gemm='emulate' (or 'auto').")
    return spec.gemm


def swap(model: nn.Module, spec: Any, device: torch.device) -> list[Decision]:
    """Turn the eligible linears of ``model`` into ``Fp8Linear`` in place; returns every decision."""
    decisions = decide(model, spec)
    cfg = Fp8Config.from_spec(spec, backend_for(spec, device))
    modules = dict(model.named_modules())
    for d in decisions:
        if d.fp8:
            convert_(modules[d.name], cfg, d.name, spec.amax_history_len)
    return decisions


def convert_(m: nn.Module, cfg: Fp8Config, name: str = "", history_len: int = 1024) -> Fp8Matmul:
    """Make one ``nn.Linear`` an ``Fp8Linear`` (a ``Conv1D`` its fp8 subclass) in place, its
    parameters untouched."""
    if not isinstance(m, Fp8Matmul):
        original = type(m)
        m.__class__ = conv1d.fp8_class_for(original) if conv1d.is_conv1d(m) else Fp8Linear
        m.fp8_original_class = original  # type: ignore[attr-defined]
    m.fp8_config, m.fp8_name, m.fp8_observers = cfg, name, ()  # type: ignore[attr-defined]
    for buf in _BUFFERS:
        m._buffers.pop(buf, None)
    if cfg.scaling == "delayed":  # TE starts from scale 1 and an empty history
        w = m.weight
        m.register_buffer("fp8_amax_history", torch.zeros(history_len, 3, device=w.device), persistent=False)
        m.register_buffer("fp8_scale", torch.ones(3, device=w.device), persistent=False)
    return m  # type: ignore[return-value]


def fp8_layers(model: nn.Module) -> list[tuple[str, Any]]:
    """``(qualified name, layer)`` for every fp8 layer (``Fp8Linear``, fp8 ``Conv1D``) in ``model``."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, Fp8Matmul)]


def remove_fp8(model: nn.Module) -> nn.Module:
    """Undo the fp8 swap in place: every fp8 layer becomes the class it was, with the same
    parameters (never stored in fp8) and without the fp8 buffers. Returns ``model``."""
    for _, m in fp8_layers(model):
        original = m.__dict__.get("fp8_original_class", nn.Linear)
        for buf in _BUFFERS:
            m._buffers.pop(buf, None)
        for attr in _ATTRS:
            m.__dict__.pop(attr, None)
        m.__class__ = original
    return model
