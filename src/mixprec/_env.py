"""Environment switches, read without importing torch (the memory planner's arithmetic path runs
without it, and must read them too).

``MIXPREC_MASTER_WORKSPACE``: "free" (the default) allocates the flat temporaries of a 16-bit
storage recipe's bucketed step afresh each step; "keep" keeps them between steps on a CPU
(``mixprec.masters.buckets._Workspace``). ``MIXPREC_MASTER_KERNELS`` (``mixprec.masters.kernels``)
is read through ``env_choice`` too.
"""

from __future__ import annotations

import os

WORKSPACE_ENV = "MIXPREC_MASTER_WORKSPACE"
WORKSPACE_MODES = ("free", "keep")


def env_choice(name: str, choices: tuple[str, ...], what: str) -> str:
    """The environment variable ``name``, one of ``choices`` (the first is the default when unset or
    empty); any other value is a ValueError that lists the choices and says ``what`` they mean."""
    value = os.environ.get(name, choices[0]).strip().lower() or choices[0]
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(choices)}: {what}")
    return value


def workspace_mode() -> str:
    """``MIXPREC_MASTER_WORKSPACE``, checked: "free" or "keep"."""
    return env_choice(WORKSPACE_ENV, WORKSPACE_MODES, "'keep' keeps the 16-bit storage recipes' step temporaries "
                      "allocated between steps on a CPU (faster, more resident memory), 'free' allocates them each step")
