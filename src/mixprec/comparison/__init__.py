"""``mixprec compare``: does mixed precision track fp32 on a model, within fp32's own noise?

- ``api.compare``: train a task under each recipe and under fp32 from several seeds; judge.
- ``runner``: one training run and its per-step records.
- ``verdict``: the rule (smoothing, the fp32 noise band, TRACKS / DIVERGES / NON-FINITE).
- ``report``: terminal summary, HTML, PNG, JSON and CSV.
- ``cli``: the ``mixprec compare`` command.

The package is named ``comparison`` so that ``mixprec.compare`` stays the function: a subpackage
called ``compare`` would replace it on ``mixprec`` as soon as it was imported.
"""

from __future__ import annotations

from mixprec._lazy import lazy_exports

_EXPORTS = {
    "compare": "mixprec.comparison.api",
    "ComparisonResult": "mixprec.comparison.api",
    "RunResult": "mixprec.comparison.runner",
    "Verdict": "mixprec.comparison.verdict",
    "VerdictRule": "mixprec.comparison.verdict",
}
__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS, globals())[0]  # ``mixprec compare --help`` loads no torch
