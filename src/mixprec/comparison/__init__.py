"""``mixprec compare``: does mixed precision track fp32 on a model, within fp32's own noise?

- ``api.compare``: train a task under each recipe and under fp32 from several seeds; judge.
- ``runner``: one training run and its per-step records.
- ``verdict``: the rule (smoothing, the fp32 noise band, TRACKS / DIVERGES / NON-FINITE).
- ``report``: terminal summary, HTML, PNG, JSON and CSV.
- ``cli``: the ``mixprec compare`` command.

The package is named ``comparison`` so that ``mixprec.compare`` stays the function: a subpackage
called ``compare`` would replace it on ``mixprec`` as soon as it was imported.
"""
