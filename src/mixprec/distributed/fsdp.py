"""A recipe as FSDP2: ``fully_shard`` with a ``MixedPrecisionPolicy`` per group of modules.

Sharded parameters stay fp32 (for a 16-bit storage recipe they *are* the fp32 masters), so the
optimizer, which is built over them, keeps its state sharded and in fp32. For the forward and
backward each unit's parameters are all-gathered in the dtype the recipe computes them in, and
the gradients are reduce-scattered in ``FSDP.reduce_dtype`` (fp32 unless asked otherwise).

Which parameters are gathered in 16 bits: exactly those the one-process recipe computes with in
16 bits, so that a rank computes what one process computes on its micro-batch:

- the weights of matmul modules (Linear, Conv, Bilinear, MultiheadAttention, Hugging Face's
  ``Conv1D`` of GPT-2's blocks, an ``addmm``) that are not fp32 islands: autocast casts them to the
  compute dtype anyway (their biases too);
- for 16-bit storage recipes, also the parameters of other modules that the recipe stores in 16
  bits (not kept fp32 by its ``fp32_params`` rule);
- everything else is gathered in fp32: the fp32 islands (the norms) and the modules inside them,
  embeddings (``F.embedding`` is not autocast, so a bf16 table would make a bf16 residual stream),
  and, for the mixed recipes, any other module's own parameters (a learned scale used in an
  elementwise op sees its fp32 value on one process).

FSDP2 puts one policy on a group of modules, so each unit is sharded as two groups: its fp32
modules (``fully_shard([...])``: one group, one all-gather) and the rest. Modules that share a
parameter (tied weights: GPT-2's ``wte`` and ``lm_head``, T5's ``shared``, both ``embed_tokens`` and
``lm_head``) are one group of their own, made first: FSDP2 lets a parameter belong to one group
only. It is gathered in fp32 when any of them uses the parameter in fp32 (an embedding), as one
process holds it; autocast still computes ``lm_head`` in the compute dtype. ``cast_forward_inputs``
is off: autocast decides what each op computes in, as on one process (with it on, every unit's
fp32 input, the residual stream, would be cast to 16 bits).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mixprec.islands import island_names, module_matches_rule
from mixprec.masters import fp32_param_names
from mixprec.recipes import Recipe

#: modules whose parameters only ever meet autocast-lowered ops (matmul, linear, conv)
MATMUL_MODULES: tuple[type[nn.Module], ...] = (nn.Linear, nn.Bilinear, nn.modules.conv._ConvNd, nn.MultiheadAttention)



def is_matmul(module: nn.Module) -> bool:
    """A module whose parameters only ever meet autocast-lowered ops (``MATMUL_MODULES``, or Hugging
    Face's ``Conv1D``: ``addmm(bias, x, weight)``; matched by name, transformers is not imported)."""
    cls = type(module)
    return isinstance(module, MATMUL_MODULES) or (cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers"))


def tied(model: nn.Module) -> list[list[str]]:
    """The modules that share a parameter, as lists of qualified names (each list one group of ties)."""
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        for _, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append(name)
    parent: dict[str, str] = {}

    def find(n: str) -> str:
        while parent.get(n, n) != n:
            n = parent[n]
        return n

    for names in owners.values():
        for other in names[1:]:
            parent[find(other)] = find(names[0])
    classes: dict[str, list[str]] = {}
    for names in owners.values():
        if len(names) > 1:
            classes.setdefault(find(names[0]), [])
    for n in {n for names in owners.values() if len(names) > 1 for n in names}:
        classes[find(n)].append(n)
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    return [sorted(set(c), key=order.__getitem__) for c in classes.values()]


#: master-weight strategies FSDP2 can be: the sharded fp32 parameter is the master
SHARDABLE_MASTERS = ("none", "fp32")


def unsupported(recipe: Recipe) -> str | None:
    """Why FSDP2 cannot run ``recipe`` (None when it can)."""
    if recipe.pure:
        return (f"recipe {recipe.name!r} keeps the whole model in 16 bits, norms included, with no master; "
                "FSDP2 shards fp32 parameters. Use bf16-true (fp32 masters, sharded) or a -mixed recipe")
    if recipe.master not in SHARDABLE_MASTERS:
        return (f"recipe {recipe.name!r} keeps no fp32 master (strategy {recipe.master!r}) to save 2-4 bytes per "
                "parameter; under FSDP2 the sharded fp32 parameter is the master and costs 4/N bytes per parameter "
                "per rank, so there is nothing to save. Use 'bf16-true' (sharded fp32 masters, bf16 compute "
                "parameters) with parallel='fsdp', or keep this recipe with parallel='ddp'")
    return None


def fp32_modules(model: nn.Module, recipe: Recipe, fp32_params: Any) -> set[str]:
    """Qualified names of the modules whose own parameters are gathered in fp32 (see the module docstring)."""
    islands = island_names(model)
    kept = set(fp32_param_names(model, fp32_params)) if recipe.stores_16bit else set()
    out: set[str] = set()
    for name, module in model.named_modules():
        own = [(local, p) for local, p in module.named_parameters(recurse=False) if p.is_floating_point()]
        if not own:
            continue
        if any(i == "" or name == i or name.startswith(i + ".") for i in islands):
            out.add(name)
        elif is_matmul(module) and getattr(module, "fp8_config", None) is None:
            continue  # (an fp8 layer casts its fp32 weight itself: gathered in bf16, it would be rounded twice)
        elif not recipe.stores_16bit or any((f"{name}.{local}" if name else local) in kept for local, _ in own):
            out.add(name)
    return out


def units(model: nn.Module, rules: Any) -> list[str]:
    """The qualified names of the modules sharded as units, deepest first (the root is not one)."""
    named = list(model.named_modules())
    if rules is None:
        chosen = [f"{n}.{child}" if n else child for n, m in named if isinstance(m, nn.ModuleList)
                  for child, _ in m.named_children()]
    else:
        rules = list(rules)
        chosen = [n for n, m in named if n and any(module_matches_rule(n, m, r) for r in rules)]
        for r in rules:
            if isinstance(r, str) and not any(module_matches_rule(n, m, r) for n, m in named if n):
                raise ValueError(f"FSDP(units=...) rule {r!r} matches no submodule of {type(model).__name__}; use a "
                                 "qualified name from model.named_modules(), a class or a class name")
    order = {n: i for i, (n, _) in enumerate(named)}
    return sorted(set(chosen), key=lambda n: (-n.count("."), order[n]))  # deepest first, then in model order


def _policy(param_dtype: torch.dtype | None, reduce_dtype: torch.dtype, output_dtype: torch.dtype | None = None):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, output_dtype=output_dtype,
                                cast_forward_inputs=False)


def shard(model: nn.Module, recipe: Recipe, fp32_params: Any, cfg: Any, mesh: Any) -> list[tuple[str, str]]:
    """Apply ``fully_shard`` to ``model`` in place (already prepared for ``recipe`` on one process,
    without masters). Returns the groups made, ``(unit, "fp32" | "compute")`` with ``unit`` a
    qualified name ("" for the root), in the order they were made."""
    from torch.distributed.fsdp import fully_shard

    compute = recipe.compute_dtype if recipe.compute_dtype != torch.float32 else None
    fp32 = fp32_modules(model, recipe, fp32_params) if compute is not None else set()
    modules = dict(model.named_modules())
    owners = [n for n, m in modules.items() if any(p.is_floating_point() for p in m.parameters(recurse=False))]
    done: set[str] = set()  # modules whose own parameters a group already holds
    groups: list[tuple[str, str]] = []
    common = {"mesh": mesh, "reshard_after_forward": cfg.reshard_after_forward}

    def under(name: str, top: str) -> bool:
        return top == "" or name == top or name.startswith(top + ".")

    def group(names: list[str], kind: str, unit: str, output: torch.dtype | None = None) -> None:
        policy = _policy(compute if kind == "compute" else None, cfg.reduce_dtype, output)
        targets = [modules[n] for n in names]
        fully_shard(targets if len(targets) > 1 else targets[0], mp_policy=policy, **common)
        groups.append((unit, kind))
        done.update(o for o in owners if any(under(o, n) for n in names))

    def shard_unit(unit: str, output: torch.dtype | None = None) -> None:
        left = [o for o in owners if under(o, unit) and o not in done]
        kinds = {o: "fp32" if o in fp32 else "compute" for o in left}
        present = set(kinds.values())
        if len(present) == 2:
            # one kind as a list group first (the top-most modules of that kind, each of whose subtrees
            # holds only that kind), then the unit takes the rest; else every owner alone, deepest first
            for first in ("fp32", "compute"):
                mine = [o for o in left if kinds[o] == first]
                tops = [o for o in mine if not any(t != o and under(o, t) for t in mine)]
                if all(kinds[o] == first for t in tops for o in left if under(o, t)):
                    group(tops, first, unit)
                    break
            else:
                for o in sorted(left, key=lambda n: -n.count(".")):
                    if o != unit:
                        group([o], kinds[o], unit)
        rest = [o for o in owners if under(o, unit) and o not in done]
        kind = kinds[rest[0]] if rest and len({kinds[o] for o in rest}) == 1 else "compute"
        group([unit], kind, unit, output)

    unit_names = units(model, cfg.units)
    for ties in tied(model):  # one group each, before the units (a parameter belongs to one group)
        kind = "fp32" if any(t in fp32 for t in ties) else "compute"
        holder = next((u for u in unit_names if all(under(t, u) for t in ties)), "")  # (deepest first)
        group(ties, kind, holder)
    for unit in unit_names:
        shard_unit(unit)
    shard_unit("", recipe.policy.output_dtype if compute is not None else None)
    return groups
