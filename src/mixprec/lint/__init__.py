"""``mixprec lint``: find the mixed-precision traps in a training script by reading its text.

It never imports torch: a script is parsed with :mod:`ast`, names are resolved from its imports,
and the rules read the order of calls in each function. See ``RULES`` for what is checked.

    >>> from mixprec.lint import lint_source
    >>> code = '''
    ... import torch
    ... def train(model, loader, opt):
    ...     scaler = torch.amp.GradScaler("cuda")
    ...     for x, y in loader:
    ...         with torch.autocast("cuda", dtype=torch.float16):
    ...             loss = model(x, y)
    ...         scaler.scale(loss).backward()
    ...         torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    ...         scaler.step(opt)
    ...         scaler.update()
    ... '''
    >>> [(f.line, f.code) for f in lint_source(code)]
    [(9, 'MP101')]
"""

from mixprec.lint.engine import LintResult, fix_source, lint_paths, lint_source
from mixprec.lint.report import Finding
from mixprec.lint.rules import RULES, Rule

__all__ = ["RULES", "Finding", "LintResult", "Rule", "fix_source", "lint_paths", "lint_source"]
