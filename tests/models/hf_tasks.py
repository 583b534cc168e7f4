"""The model families of ``hf_zoo`` as ``mixprec.tasks.Task`` factories (``make(family)``,
``make_gpt2``...), for ``doctor`` and ``compare`` in the tests: HF computes the loss inside its
forward (``labels=``), so ``loss_fn`` reads ``out.loss``."""

from __future__ import annotations

from hf_zoo import FAMILIES, batch, build
from mixprec.tasks import Task


def make(family: str, steps: int = 20, lr: float | None = None) -> Task:
    import torch

    return Task(
        name=f"hf-{family}",
        build_model=lambda: build(family),
        get_batch=lambda step: (batch(family, step), None),
        loss_fn=lambda out, _: out.loss,
        forward=lambda model, inputs: model(**inputs),
        build_optimizer=(lambda ps: torch.optim.AdamW(ps, lr=lr)) if lr else (lambda ps: torch.optim.AdamW(ps, lr=1e-3)),
        steps=steps,
        description=f"Hugging Face {family} from a tiny config",
    )


def _factory(family: str):
    def factory() -> Task:
        return make(family)

    factory.__name__ = f"make_{family}"
    return factory


for _f in FAMILIES:
    globals()[f"make_{_f}"] = _factory(_f)
