"""mixprec.GradScaler against torch.amp.GradScaler, in lock-step, over thousands of random steps.

Both scalers drive identical models on identical batches; inf/NaN are injected into random
gradients; several optimizers, gradient accumulation, clipping, fused and unfused optimizers.
After every step the scale, the skip decision, every parameter and the optimizer state must be
bitwise identical.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

import mixprec

OPTIMIZERS = {
    "sgd": lambda ps, fused: torch.optim.SGD(ps, lr=0.05, momentum=0.9, fused=fused),
    # fused SGD with momentum is excluded from the lock-step comparison: torch's scaler lets it
    # corrupt its momentum on skipped steps, mixprec's does not (tested separately below)
    "sgd-plain": lambda ps, fused: torch.optim.SGD(ps, lr=0.05, fused=fused),
    "adam": lambda ps, fused: torch.optim.Adam(ps, lr=1e-2, fused=fused),
    "adamw": lambda ps, fused: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=fused),
    "adagrad": lambda ps, fused: torch.optim.Adagrad(ps, lr=0.05, fused=fused),
}


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)
    )


def _found_inf(scaler, opts) -> bool:
    return bool(sum(float(v) for o in opts for v in scaler._found_inf_per_device(o).values()))


def _assert_same(a: torch.nn.Module, b: torch.nn.Module, opts_a, opts_b, where: str) -> None:
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), f"{where}: parameter {name} differs"
    for oa, ob in zip(opts_a, opts_b):
        sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
        assert sa.keys() == sb.keys(), where
        for k in sa:
            for field in sa[k]:
                assert torch.equal(torch.as_tensor(sa[k][field]), torch.as_tensor(sb[k][field])), (
                    f"{where}: optimizer state {k}.{field} differs"
                )


def run_lockstep(
    seed: int,
    steps: int,
    *,
    fused: bool,
    optimizers: tuple[str, ...],
    accumulate: int,
    clip: bool,
    scaler_kwargs: dict,
    mixprec_extra: dict | None = None,
    inject_p: float = 0.15,
) -> dict[str, int]:
    rng = random.Random(seed)
    model_t = _model(seed)
    model_m = copy.deepcopy(model_t)
    # Split the layers between the optimizers (several optimizers share one scaler).
    layers_t = [m for m in model_t if isinstance(m, torch.nn.Linear)]
    layers_m = [m for m in model_m if isinstance(m, torch.nn.Linear)]
    groups = [[i for i in range(len(layers_t)) if i % len(optimizers) == k] for k in range(len(optimizers))]
    opts_t = [OPTIMIZERS[o]([p for i in g for p in layers_t[i].parameters()], fused) for o, g in zip(optimizers, groups)]
    opts_m = [OPTIMIZERS[o]([p for i in g for p in layers_m[i].parameters()], fused) for o, g in zip(optimizers, groups)]
    sc_t = torch.amp.GradScaler("cpu", **scaler_kwargs)
    sc_m = mixprec.GradScaler("cpu", **scaler_kwargs, **(mixprec_extra or {}))
    counts = {"steps": 0, "skipped": 0, "grew": 0}
    params_t = list(model_t.parameters())
    params_m = list(model_m.parameters())
    assert len(params_t) == len(params_m)
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        for _ in range(accumulate):
            x = torch.randn(5, 6, generator=gen) * (10.0 ** rng.uniform(-1, 1))
            y = torch.randint(0, 3, (5,), generator=gen)
            for model, sc in ((model_t, sc_t), (model_m, sc_m)):
                loss = torch.nn.functional.cross_entropy(model(x), y) / accumulate
                sc.scale(loss).backward()
        if rng.random() < inject_p:
            i = rng.randrange(len(params_t))
            idx = tuple(rng.randrange(s) for s in params_t[i].shape)
            bad = rng.choice([float("inf"), float("-inf"), float("nan")])
            params_t[i].grad[idx] = bad
            params_m[i].grad[idx] = bad
        before = sc_t.get_scale()
        assert before == sc_m.get_scale(), f"step {step}: scale before differs"
        for sc, opts in ((sc_t, opts_t), (sc_m, opts_m)):
            if clip:
                # Per optimizer, as torch documents for several optimizers: each decides its own
                # skip, so a joint clip would spread one optimizer's inf into the others' grads.
                for o in opts:
                    sc.unscale_(o)
                    torch.nn.utils.clip_grad_norm_([p for g in o.param_groups for p in g["params"]], 1.0)
            for o in opts:
                sc.step(o)
        found_t, found_m = _found_inf(sc_t, opts_t), _found_inf(sc_m, opts_m)
        assert found_t == found_m, f"step {step}: skip decision differs"
        for sc in (sc_t, sc_m):
            sc.update()
        for o in (*opts_t, *opts_m):
            o.zero_grad(set_to_none=True)
        after = sc_t.get_scale()
        assert after == sc_m.get_scale(), f"step {step}: scale after update differs ({after} vs {sc_m.get_scale()})"
        assert sc_m.was_skipped() == found_t
        _assert_same(model_t, model_m, opts_t, opts_m, f"step {step}")
        counts["steps"] += 1
        counts["skipped"] += found_t
        counts["grew"] += after > before
    assert sc_t.state_dict() == {k: v for k, v in sc_m.state_dict().items() if k != "mixprec"}
    return counts


CONFIGS = [
    # (fused, optimizers, accumulate, clip, scaler kwargs)
    (False, ("adamw",), 1, True, {"init_scale": 2.0**12, "growth_interval": 4}),
    (True, ("adamw",), 1, True, {"init_scale": 2.0**12, "growth_interval": 4}),
    (False, ("sgd", "adam"), 2, False, {"init_scale": 2.0**20, "growth_interval": 3}),
    (True, ("sgd-plain", "adam"), 2, True, {"init_scale": 2.0**20, "growth_interval": 3}),
    (False, ("adagrad",), 3, True, {"init_scale": 300.0, "growth_factor": 1.5, "backoff_factor": 0.7, "growth_interval": 2}),
    (True, ("adagrad", "adamw"), 1, False, {"init_scale": 300.0, "growth_factor": 1.5, "backoff_factor": 0.7, "growth_interval": 2}),
]


@pytest.mark.parametrize("fused,optimizers,accumulate,clip,kwargs", CONFIGS)
def test_matches_torch_gradscaler_bitwise_over_random_steps(fused, optimizers, accumulate, clip, kwargs):
    counts = run_lockstep(
        seed=hash((fused, optimizers, accumulate)) % 1000,
        steps=300,
        fused=fused,
        optimizers=optimizers,
        accumulate=accumulate,
        clip=clip,
        scaler_kwargs=kwargs,
    )
    # The run must have exercised both branches, or it proved nothing.
    assert counts["skipped"] > 20 and counts["grew"] > 20, counts


@pytest.mark.parametrize("fused", [False, True])
def test_bounded_update_path_matches_torch_when_bounds_are_not_hit(fused):
    """min/max scale switch to mixprec's own device-side update; it must round exactly like torch's kernel."""
    counts = run_lockstep(
        seed=7,
        steps=600,
        fused=fused,
        optimizers=("adam",),
        accumulate=1,
        clip=True,
        scaler_kwargs={"init_scale": 1000.0, "growth_factor": 1.7, "backoff_factor": 0.55, "growth_interval": 3},
        mixprec_extra={"min_scale": 1e-30, "max_scale": 1e30},
    )
    assert counts["skipped"] > 20 and counts["grew"] > 20, counts


def test_fused_sgd_momentum_is_not_corrupted_by_a_skipped_step_unlike_torch():
    """torch's fused SGD writes its momentum buffer on a skipped step; mixprec routes it unfused."""
    results = {}
    for name, cls in (("torch", torch.amp.GradScaler), ("mixprec", mixprec.GradScaler)):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.ones(4))
        opt = torch.optim.SGD([w], lr=0.1, momentum=0.9, fused=True)
        scaler = cls("cpu", init_scale=4.0)
        scaler.scale((w * 2).sum()).backward()
        w.grad[1] = float("inf")  # overflow on the very first step: it must be skipped
        scaler.step(opt)
        scaler.update()
        results[name] = (w.detach().clone(), dict(opt.state.get(w, {})))
    w_m, state_m = results["mixprec"]
    assert torch.equal(w_m, torch.ones(4)) and state_m == {}, "skipped step must leave SGD untouched"
    # torch's path created (and possibly garbage-filled) the buffer: the defect mixprec avoids
    assert "momentum_buffer" in results["torch"][1]
