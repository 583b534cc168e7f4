"""One training iteration through mixprec, Hugging Face Accelerate and Lightning Fabric, against
the same iteration written by hand (torch.autocast + torch.amp.GradScaler): what each wrapper costs.

Every arm trains its own copy of the same model (same seed) on the same batches; the arms run
interleaved, one iteration each per round in a rotating order, and the ratio arm / hand is formed
per round (paired), so load that drifts over the run cancels. Accelerate and Fabric are timed when
installed (``pip install -e ".[transformers]"`` brings accelerate, ``".[lightning]"`` Fabric).

Each arm also reports the dtype its linear layers computed in: a wrapper that silently ran another
recipe (Accelerate's fp16 on a CPU runs fp32, Lightning's 16-mixed runs bf16) is marked so.

    python benchmarks/peers_overhead.py                              # every model, bf16-mixed, 1 and 2 threads
    python benchmarks/peers_overhead.py --models mlp --recipes fp16-mixed --threads 1 --rounds 100
    python benchmarks/peers_overhead.py --models tensors --tensors 10 100 1000   # how the step grows
    python benchmarks/peers_overhead.py --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import sys
import time
import warnings
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import mixprec  # noqa: E402
from mixprec.instruments.machine import describe, environment  # noqa: E402
from mixprec.instruments.timing import interleaved_order, paired_ratio, Summary  # noqa: E402

DTYPES = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16, "fp32": None}


def build(kind: str, tensors: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A model, an input and a target: the block (compute-bound), a small MLP (overhead-bound), or
    a stack of tiny linears holding ``tensors`` parameter tensors (the step's per-tensor cost)."""
    g = torch.Generator().manual_seed(0)
    if kind == "block":
        model = nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True)
        x = torch.randn(16, 64, 256, generator=g)
    elif kind == "mlp":
        model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 10))
        x = torch.randn(32, 64, generator=g)
    else:  # "tensors": tensors / 2 Linear(16, 16) layers (weight + bias each)
        model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(max(1, tensors // 2))])
        x = torch.randn(8, 16, generator=g)
    with torch.no_grad():
        y = torch.randn(model(x).shape, generator=g)
    return model, x, y


class _DtypeProbe:
    """Records the dtype the first Linear (or attention projection) outputs: what the arm really ran."""

    def __init__(self, model: nn.Module) -> None:
        self.dtype: torch.dtype | None = None
        first = next(m for m in model.modules() if isinstance(m, (nn.Linear, nn.MultiheadAttention)))
        first.register_forward_hook(self._hook)

    def _hook(self, module: nn.Module, args: Any, out: Any) -> None:
        t = out[0] if isinstance(out, tuple) else out
        self.dtype = t.dtype


def arms(kind: str, tensors: int, recipe: str, fused: bool) -> dict[str, Any]:
    """name -> a zero-argument iteration (forward, backward, step), each over its own model copy."""
    dtype = DTYPES[recipe]
    out: dict[str, Any] = {}

    def fresh():
        torch.manual_seed(0)
        model, x, y = build(kind, tensors)
        return model, x, y, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)

    # the hand-written loop (torch.autocast + torch.amp.GradScaler, the seeds' fp16 loop)
    model, x, y, opt = fresh()
    scaler = torch.amp.GradScaler("cpu", enabled=dtype is torch.float16)
    probe = _DtypeProbe(model)

    def hand(model=model, x=x, y=y, opt=opt, scaler=scaler):
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            out_ = model(x)
        loss = nn.functional.mse_loss(out_.float(), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    out["hand"] = (hand, probe)

    model, x, y, opt = fresh()
    mp = mixprec.MixedPrecision(recipe, "cpu")
    probe = _DtypeProbe(model)  # before prepare: islands wrap the norms, not the linears
    model = mp.prepare(model)

    def mixprec_arm(model=model, x=x, y=y, opt=opt, mp=mp):
        with mp.autocast():
            out_ = model(x)
        mp.step(nn.functional.mse_loss(out_, y), opt, max_grad_norm=1.0)
    out["mixprec"] = (mixprec_arm, probe)

    with contextlib.suppress(ImportError):
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState

        # Accelerate keeps one state per process; a benchmark that changes the precision resets it
        # (a private method: this script only, never the library)
        AcceleratorState._reset_state(reset_partial_state=True)
        model, x, y, opt = fresh()
        probe = _DtypeProbe(model)
        acc = Accelerator(cpu=True, mixed_precision={"bf16-mixed": "bf16", "fp16-mixed": "fp16"}.get(recipe, "no"))
        model, opt = acc.prepare(model, opt)

        def accelerate_arm(model=model, x=x, y=y, opt=opt, acc=acc):
            with acc.autocast():
                out_ = model(x)
            acc.backward(nn.functional.mse_loss(out_.float(), y))
            acc.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        out["accelerate"] = (accelerate_arm, probe)

    with contextlib.suppress(ImportError):
        from lightning.fabric import Fabric

        model, x, y, opt = fresh()
        probe = _DtypeProbe(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Fabric's notes about CPU precision, measured below instead
            fabric = Fabric(accelerator="cpu", devices=1,
                            precision={"bf16-mixed": "bf16-mixed", "fp16-mixed": "16-mixed"}.get(recipe, "32-true"))
        model, opt = fabric.setup(model, opt)

        def fabric_arm(model=model, x=x, y=y, opt=opt, fabric=fabric):
            out_ = model(x)
            fabric.backward(nn.functional.mse_loss(out_.float(), y))
            fabric.clip_gradients(model, opt, max_norm=1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        out["fabric"] = (fabric_arm, probe)
    return out


def run(kind: str, tensors: int, recipe: str, fused: bool, rounds: int, warmup: int) -> dict[str, Any]:
    fns = arms(kind, tensors, recipe, fused)
    for _ in range(warmup):
        for fn, _probe in fns.values():
            fn()
    times: dict[str, list[float]] = {n: [] for n in fns}
    for _r, name in interleaved_order(list(fns), rounds):
        fn = fns[name][0]
        t0 = time.perf_counter()
        fn()
        times[name].append(time.perf_counter() - t0)
    want = DTYPES[recipe] or torch.float32
    res = {"model": kind, "tensors": sum(1 for _ in build(kind, tensors)[0].parameters()), "recipe": recipe,
           "optimizer": "AdamW(fused)" if fused else "AdamW(foreach)", "threads": torch.get_num_threads(), "arms": {}}
    for name, (fn, probe) in fns.items():
        res["arms"][name] = {
            "ms": Summary.of(times[name]).median * 1e3,
            "ratio_vs_hand": None if name == "hand" else paired_ratio(times[name], times["hand"]),
            "computed_in": str(probe.dtype).removeprefix("torch."),
            "ran_what_was_asked": probe.dtype == want,
        }
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["block", "mlp", "tensors"], choices=("block", "mlp", "tensors"))
    ap.add_argument("--tensors", nargs="+", type=int, default=[1000], help="parameter tensors of the 'tensors' model")
    ap.add_argument("--recipes", nargs="+", default=["bf16-mixed"], choices=tuple(DTYPES))
    ap.add_argument("--optimizer", nargs="+", default=["foreach"], choices=("foreach", "fused"))
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    env = environment("cpu")
    print(f"machine: {describe(env)}")
    results = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for kind in args.models:
            for n in (args.tensors if kind == "tensors" else [0]):
                for recipe in args.recipes:
                    for opt in args.optimizer:
                        r = run(kind, n, recipe, opt == "fused", args.rounds, args.warmup)
                        results.append(r)
                        cells = []
                        for name, a in r["arms"].items():
                            ratio = a["ratio_vs_hand"]
                            text = f"{a['ms']:.3g} ms" if ratio is None else \
                                f"{ratio['median']:.3f} ({ratio['ci95_low']:.3f}-{ratio['ci95_high']:.3f})"
                            if not a["ran_what_was_asked"]:
                                text += f" RAN {a['computed_in']}"
                            cells.append(f"{name} {text}")
                        print(f"{kind}{'/' + str(r['tensors']) if kind == 'tensors' else ''} {recipe} {r['optimizer']} "
                              f"{threads}t: " + " | ".join(cells), flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"env": env, "results": results}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
