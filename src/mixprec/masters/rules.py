r"""Which parameters a 16-bit-storage recipe leaves in fp32.

The rule is a list of items; a parameter stays fp32 when any item matches it:

- ``"norms"``: parameters of normalisation modules, as ``mixprec.islands.is_norm`` recognises
  them (torch's norm classes, and classes named like one such as ``LlamaRMSNorm`` or
  ``T5LayerNorm``): few bytes, and a norm's scale multiplies every activation.
- ``"biases"``: every parameter named ``bias``: one value per output feature, so a bf16 rounding
  of it shifts a whole channel; they cost almost nothing.
- ``"embeddings"``: parameters of ``nn.Embedding`` / ``nn.EmbeddingBag``: rows of rare tokens get
  tiny, rare updates, the case where 16-bit rounding loses the most.
- ``"bare"``: every parameter that is not the weight of a matmul or convolution, i.e. not named
  ``weight`` (or ``*_weight``) with 2 or more dimensions: bare ``nn.Parameter``\ s added to the
  activations (a ViT's ``cls_token`` and ``pos_embed``, LayerScale's ``gamma``, relative-position
  tables) and 1-D scales. Under the mixed recipes they stay fp32 and so keep the residual stream
  fp32 where they are added; stored in bf16 they would not, and bf16-true would compute something
  else than bf16-mixed. They are few bytes.
- a qualified parameter name (``"head.weight"``), a module name (``"head"``: every parameter under
  it), a module class name (``"LayerNorm"``) or class, or a predicate ``(name, param) -> bool``.

The recipes' default is ``("norms", "biases", "embeddings", "bare")``: only matmul and convolution
weights are stored in 16 bits. See it with
``MixedPrecision.describe()`` and change it with ``MixedPrecision(..., fp32_params=[...])``.

>>> import torch
>>> from torch import nn
>>> net = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.LayerNorm(4))
>>> fp32_param_names(net, DEFAULT_FP32_PARAMS)
['0.weight', '1.bias', '2.weight', '2.bias']
>>> net.register_parameter("pos_embed", nn.Parameter(torch.zeros(1, 8, 4)))  # a bare parameter
>>> fp32_param_names(net, DEFAULT_FP32_PARAMS)
['pos_embed', '0.weight', '1.bias', '2.weight', '2.bias']
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from torch import nn

from mixprec.islands import module_matches_rule
from mixprec.recipes import FP32_PARAMS as DEFAULT_FP32_PARAMS  # noqa: F401  (the recipes' default rule)

ParamRule = str | type | Callable[[str, nn.Parameter], bool]

_EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)
FAMILIES = ("norms", "biases", "embeddings", "bare")


def is_matmul_weight(local: str, param: nn.Parameter) -> bool:
    """A matmul or convolution weight: named ``weight`` or ``*_weight`` (``in_proj_weight``), 2-D or more."""
    return (local == "weight" or local.endswith("_weight")) and param.dim() >= 2


def _matches(rule: ParamRule, qual: str, local: str, module_name: str, module: nn.Module, param: nn.Parameter) -> bool:
    if isinstance(rule, type):
        return isinstance(module, rule)
    if callable(rule):
        return bool(rule(qual, param))
    if rule == "norms":
        return module_matches_rule(module_name, module, "norms")
    if rule == "biases":
        return local == "bias"
    if rule == "embeddings":
        return isinstance(module, _EMBEDDINGS)
    if rule == "bare":
        return not is_matmul_weight(local, param)
    return (
        qual == rule
        or module_name == rule
        or module_name.startswith(rule + ".")
        or type(module).__name__ == rule
    )


def _occurrences(model: nn.Module) -> Iterator[tuple[str, str, str, nn.Module, nn.Parameter]]:
    """Every (qualified name, local name, module name, module, param), tied parameters once per owner."""
    for module_name, module in model.named_modules():
        for local, param in module.named_parameters(recurse=False):
            yield (f"{module_name}.{local}" if module_name else local), local, module_name, module, param


def fp32_param_names(model: nn.Module, rules: Sequence[ParamRule]) -> list[str]:
    """Qualified names (as ``model.named_parameters()`` gives them) of the floating parameters
    ``rules`` keeps in fp32.

    A tied parameter stays fp32 when any of its owners matches. Raises ValueError when a name in
    ``rules`` matches nothing: a typo would otherwise silently store that parameter in 16 bits.
    """
    rules = list(rules)
    for r in rules:
        if not isinstance(r, (str, type)) and not callable(r):
            raise TypeError(
                f"fp32_params rule items are names, module classes or predicates (name, param) -> bool; "
                f"got {type(r).__name__}"
            )
    keep: set[int] = set()
    used: set[int] = set()
    for qual, local, module_name, module, param in _occurrences(model):
        for i, r in enumerate(rules):
            if _matches(r, qual, local, module_name, module, param):
                used.add(i)
                keep.add(id(param))
    for i, r in enumerate(rules):
        if isinstance(r, str) and r not in FAMILIES and i not in used:
            raise ValueError(
                f"fp32_params rule {r!r} matches no parameter of {type(model).__name__}; use a name from "
                f"model.named_parameters() or model.named_modules(), a module class (name), a predicate, "
                f"or one of {list(FAMILIES)}"
            )
    return [n for n, p in model.named_parameters() if id(p) in keep and p.is_floating_point()]


def _every_parameter(name: str, param: nn.Parameter) -> bool:
    """The whole model as an island (``fp32_modules=[""]``): every parameter stays fp32."""
    return True


def island_param_rules(model: nn.Module, islands: list[str]) -> tuple[ParamRule, ...]:
    """The fp32_params rules that keep the islands' parameters fp32. An island that owns no floating
    parameter (a norm without affine weights, a softmax module) adds no rule: as a name it would match
    no parameter, and the masters refuse such a rule (``bf16-true`` refused ``LayerNorm(elementwise_affine=
    False)``, found by a probe of ``compare --explain``)."""
    modules = dict(model.named_modules())
    rules: list[ParamRule] = []
    for name in islands:
        module = modules.get(name)
        if module is not None and any(p.is_floating_point() for p in module.parameters()):
            rules.append(name if name else _every_parameter)
    return tuple(rules)
