"""Environment switches, read without importing torch (the memory planner's arithmetic path runs
without it, and must read them too).

``MIXPREC_MASTER_WORKSPACE``: what a 16-bit storage recipe's bucketed step does with its flat
temporaries on a CPU (``mixprec.masters.buckets._Workspace``). "auto" (the default) keeps them
between steps up to ``KEEP_LIMIT_BYTES`` in all; "keep" keeps them whatever their size (one bucket's);
"free" allocates them afresh each step. ``MIXPREC_MASTER_KERNELS`` (``mixprec.masters.kernels``) is
read through ``env_choice`` too.
"""

from __future__ import annotations

import os

WORKSPACE_ENV = "MIXPREC_MASTER_WORKSPACE"
WORKSPACE_MODES = ("auto", "free", "keep")

#: What "auto" keeps at most, over every kept buffer of one ``MasterWeights``: 64 MiB. On a CPU a
#: freshly allocated buffer of a few MB costs its page faults on every step (about 1 ms of the
#: reference block's 16 ms step, for 7.5 MiB of temporaries); 64 MiB is what a small model's whole
#: bucket needs (6.7M parameters at 10 B), and a small share of the memory of a model whose bucket
#: is larger.
KEEP_LIMIT_BYTES = 64 << 20


def env_choice(name: str, choices: tuple[str, ...], what: str) -> str:
    """The environment variable ``name``, one of ``choices`` (the first is the default when unset or
    empty); any other value is a ValueError that lists the choices and says ``what`` they mean."""
    value = os.environ.get(name, choices[0]).strip().lower() or choices[0]
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(choices)}: {what}")
    return value


def workspace_mode() -> str:
    """``MIXPREC_MASTER_WORKSPACE``, checked: "auto" (the default), "free" or "keep"."""
    return env_choice(WORKSPACE_ENV, WORKSPACE_MODES, "the 16-bit storage recipes' step temporaries on a CPU: "
                      f"'auto' (the default) keeps up to {KEEP_LIMIT_BYTES >> 20} MiB of them allocated between steps, "
                      "'keep' keeps all of them (one bucket's: faster, more resident memory), 'free' allocates them "
                      "each step")


def workspace_limit(mode: str | None = None) -> int | None:
    """The bytes a ``MasterWeights`` keeps between steps on a CPU under ``mode`` (default: the
    environment's): 0 (free), ``KEEP_LIMIT_BYTES`` (auto) or None (keep: no limit)."""
    return {"free": 0, "auto": KEEP_LIMIT_BYTES, "keep": None}[mode or workspace_mode()]
