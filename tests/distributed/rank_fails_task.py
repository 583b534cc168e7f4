"""A task for ``compare --nproc 2`` whose model cannot be built on rank 1 (the tests of what the
parent prints when one rank fails)."""

import os

from mixprec.tasks import charlm


def make_task(**kwargs):
    task = charlm.make_task(**kwargs)
    build = task.build_model

    def build_model():
        if os.environ.get("RANK") == "1":
            raise OSError("rank 1 cannot read its weights: /data/w.bin is missing")
        return build()

    task.build_model = build_model
    return task
