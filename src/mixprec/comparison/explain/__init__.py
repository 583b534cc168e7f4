"""``mixprec compare --explain``: when a recipe does not track fp32, find out why and what fixes it.

- ``capture``: where the error enters: every module against fp32, on the same weights and batch
  (``sidebyside``: the recorders and the replay of one module alone);
- ``hypotheses``: the causes the debugging order names, as evidence and single changes;
- ``candidates``: one change trained on a short horizon, judged by compare's own band, stopped
  early, in parallel worker processes (``--jobs``);
- ``search``: the smallest set of fp32 islands (ranked hierarchical delta debugging);
- ``api``: ``explain()``, the order of work; ``result``: what it returns; ``report``: the files.

It lives inside ``comparison`` because it is compare's second half: it reuses compare's runs, its
runner and its verdict rule, which a separate tool could not import (a tool imports no other
tool). What it needs to know about 16-bit reductions, which the guard also watches, it measures
with ``mixprec.instruments.reductions`` (measuring code is shared through ``instruments``).
"""

from __future__ import annotations

from mixprec._lazy import lazy_exports

_EXPORTS = {
    "explain": "mixprec.comparison.explain.api",
    "Explanation": "mixprec.comparison.explain.result",
    "Finding": "mixprec.comparison.explain.result",
    "Fix": "mixprec.comparison.explain.result",
}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS, globals())[0]
