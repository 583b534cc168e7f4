"""Master weights: parameters stored in 16 bits that still train like fp32.

Recipes (``mixprec recipes`` lists them): ``bf16-true`` (fp32 masters), ``fp16-true`` / ``O2``
(fp32 masters + dynamic loss scaling), and the cheaper bf16 variants ``bf16-true-kahan``,
``bf16-true-sr``, ``bf16-true-remainder``; ``bf16-pure`` is the unsafe baseline without any.
The loop is the core one; only the optimizer is built over ``mp.parameters(model)``::

    mp = MixedPrecision("bf16-true")
    model = mp.prepare(model)                          # eligible params now stored in bf16
    opt = torch.optim.AdamW(mp.parameters(model), lr=3e-4)   # the fp32 masters
    with mp.autocast():
        loss = loss_fn(model(x), y)
    mp.step(loss, opt)                                 # steps the masters, writes bf16 back

- ``base``: ``MasterWeights``, the base of the strategies, and the contract ``MixedPrecision.step``
  relies on (attach, what the optimizer sees, the bucketed step, the state).
- ``gradients``: 16-bit gradients folded into fp32 master gradients, and the deferred ones the
  loss scaler and the clip read in place.
- ``buckets``: slots and buckets (one flat tensor per bucket in the step) and the bucketed step.
- ``variants``: the five strategies, ``STRATEGIES`` and ``make_masters``.
- ``guard``: the optimizer pre-step hook that refuses to train 16-bit weights without masters.
- ``rounding``: stochastic rounding, Kahan addition, fp32 <-> bf16 + int16 remainder.
- ``rules``: which parameters stay fp32.
- ``export``: the fp32 export (``mp.fp32_state_dict``, ``mp.save_pretrained``).
- ``strategy``: compatibility only (the old home of the above; forwards reads to them).
"""

from mixprec.masters.base import MasterWeights
from mixprec.masters.rounding import join_fp32, kahan_add_, nearest_bf16, split_fp32, stochastic_round_bf16
from mixprec.masters.rules import DEFAULT_FP32_PARAMS, fp32_param_names
from mixprec.masters.variants import (
    STRATEGIES,
    Fp32Masters,
    KahanMasters,
    NearestMasters,
    RemainderMasters,
    StochasticRoundingMasters,
    make_masters,
)

__all__ = [
    "DEFAULT_FP32_PARAMS",
    "STRATEGIES",
    "Fp32Masters",
    "KahanMasters",
    "MasterWeights",
    "NearestMasters",
    "RemainderMasters",
    "StochasticRoundingMasters",
    "fp32_param_names",
    "join_fp32",
    "kahan_add_",
    "make_masters",
    "nearest_bf16",
    "split_fp32",
    "stochastic_round_bf16",
]
