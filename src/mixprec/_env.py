"""Environment switches read without importing torch (the memory planner's arithmetic path runs
without it, and must read them too).

``MIXPREC_MASTER_WORKSPACE``: "free" (the default) allocates the flat temporaries of a 16-bit
storage recipe's bucketed step afresh each step; "keep" keeps them between steps on a CPU
(``mixprec.masters.buckets._Workspace``).
"""

from __future__ import annotations

import os

WORKSPACE_ENV = "MIXPREC_MASTER_WORKSPACE"
WORKSPACE_MODES = ("free", "keep")


def workspace_mode() -> str:
    """``MIXPREC_MASTER_WORKSPACE``, checked: "free" or "keep" (ValueError otherwise, saying which)."""
    mode = os.environ.get(WORKSPACE_ENV, "free").strip().lower() or "free"
    if mode not in WORKSPACE_MODES:
        raise ValueError(f"{WORKSPACE_ENV}={mode!r} is not one of {', '.join(WORKSPACE_MODES)}: 'keep' keeps the 16-bit "
                         "storage recipes' step temporaries allocated between steps on a CPU (faster, more resident "
                         "memory), 'free' allocates them each step")
    return mode
