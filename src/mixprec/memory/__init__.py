"""``mixprec memory``: how many bytes training a model takes under each recipe.

- ``plan``: the arithmetic (no torch): bytes per parameter by component, the activations of a
  transformer shape, the step's peak; ``facts_from_recipe`` reads a recipe's storage facts.
- ``measure``: one real step, counted component by component beside the plan (imports torch).
- ``cli``: the command.

``import mixprec.memory`` stays light (the plan's names are re-exported here; ``measure`` is not).
"""

from mixprec.memory.plan import (
    COMPONENTS,
    GB,
    OPTIMIZER_STATE_BYTES,
    ParamCounts,
    Plan,
    StorageFacts,
    TransformerShape,
    activation_bytes,
    facts_from_recipe,
    optimizer_state_bytes,
    parse_count,
    plan,
)

__all__ = [
    "COMPONENTS",
    "GB",
    "OPTIMIZER_STATE_BYTES",
    "ParamCounts",
    "Plan",
    "StorageFacts",
    "TransformerShape",
    "activation_bytes",
    "facts_from_recipe",
    "optimizer_state_bytes",
    "parse_count",
    "plan",
]
