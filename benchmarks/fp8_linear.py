"""fp8 against bf16-mixed on large linears: the matmul peaks, and a training step of a wide MLP.

    python benchmarks/fp8_linear.py --device cuda --widths 4096 8192 --compile both --json fp8_linear.json
    python benchmarks/fp8_linear.py --device cpu --widths 256 --tokens 512 --reps 3      # a dry run

Two measurements, interleaved per round so that a busy machine hurts every variant alike:

1. matmul peaks at each width (a square ``d x d x d`` product): bf16 ``F.linear`` against fp8
   ``torch._scaled_mm`` (e4m3 x e4m3, bf16 output, fast accumulation, unit scales). The issue's goal:
   fp8 >= 1.6x bf16 at 8192 (Hopper's dense fp8 peak is 2x bf16's). Not on the CPU (torch's CPU
   ``_scaled_mm`` is a reference loop: seconds for 512^3), where the row says so.
2. one training step (forward, backward, AdamW) of an MLP ``d -> 4d -> d`` on ``tokens`` tokens under
   bf16-mixed, fp8-current and fp8-delayed, eager and/or compiled, with both linears in fp8 (the
   first/last rule off: this MLP is a model's middle). Speedups are paired per round against
   bf16-mixed (eager against eager, compiled against compiled).

The published anchors: torchao reports +10-25% end to end at 8B scale and little at d~1024, where the
casts (memory-bound) weigh as much as the GEMMs they speed up.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from mixprec import MixedPrecision  # noqa: E402
from mixprec.bench.runner import environment  # noqa: E402
from mixprec.instruments.timing import Summary, interleaved_order, paired_ratio, synchronize, time_call  # noqa: E402

RECIPES = ("bf16-mixed", "fp8-current", "fp8-delayed")


def matmul_peaks(d: int, device: torch.device, reps: int) -> dict:
    """FLOP/s of a d^3 product in bf16 and (CUDA sm89+) in fp8."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(d, d, generator=g).to(device)
    b = torch.randn(d, d, generator=g).to(device)
    out: dict = {"d": d}
    a16, b16 = a.bfloat16(), b.bfloat16()
    fns = {"bf16": lambda: F.linear(a16, b16)}
    fp8 = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
    if fp8:
        a8 = a.to(torch.float8_e4m3fn)
        b8 = b.to(torch.float8_e4m3fn)  # (d, d) row-major; .t() is the column-major operand
        one = torch.ones((), device=device)
        fns["e4m3"] = lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                               use_fast_accum=True)
    else:
        out["e4m3"] = None
        out["note"] = "fp8 GEMMs need CUDA sm89+ (torch's CPU _scaled_mm is a slow reference)"
    for key, fn in fns.items():
        fn()
        secs = Summary.of([time_call(fn, device, 5) for _ in range(reps)]).median
        out[key] = 2 * d**3 / secs
    if out.get("e4m3"):
        out["fp8_vs_bf16"] = out["e4m3"] / out["bf16"]
    return out


class Mlp(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Variant:
    def __init__(self, recipe: str, d: int, tokens: int, device: torch.device, compiled: bool) -> None:
        self.label = recipe + ("+compile" if compiled else "")
        self.recipe, self.compiled = recipe, compiled
        fp8 = {"skip_first_last": False} if recipe.startswith("fp8") else None
        self.mp = MixedPrecision(recipe, device, fp8=fp8)
        torch.manual_seed(0)
        self.model = self.mp.prepare(Mlp(d).to(device))
        self.fwd = torch.compile(self.model) if compiled else self.model
        kw = {"fused": True} if device.type == "cuda" else {"foreach": True}
        self.opt = torch.optim.AdamW(self.mp.parameters(self.model), lr=1e-4, **kw)
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(tokens, d, generator=g).to(device)

    def step(self) -> None:
        with self.mp.autocast():
            out = self.fwd(self.x)
        self.mp.step(out.float().square().mean(), self.opt)


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    doc: dict = {"kind": "mixprec-fp8-linear", "env": environment(device), "args": vars(args), "peaks": [], "steps": []}
    compiles = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    t_start = time.perf_counter()
    for d in args.widths:
        doc["peaks"].append(matmul_peaks(d, device, args.reps))
        print(json.dumps(doc["peaks"][-1]), flush=True)
        variants = [Variant(r, d, args.tokens, device, c) for c in compiles for r in RECIPES]
        for v in variants:
            for _ in range(args.warmup):
                v.step()
        synchronize(device)
        samples: dict[str, list[float]] = {v.label: [] for v in variants}
        by_label = {v.label: v for v in variants}
        for _, label in interleaved_order(list(samples), args.reps):
            samples[label].append(time_call(by_label[label].step, device, 1))
            if args.budget_s and time.perf_counter() - t_start > args.budget_s:
                break
        flops = 3 * 2 * args.tokens * d * 4 * d * 2  # two GEMMs of tokens x d x 4d, forward + 2x backward
        for v in variants:
            base = "bf16-mixed" + ("+compile" if v.compiled else "")
            n = min(len(samples[base]), len(samples[v.label]))
            s = Summary.of(samples[v.label])
            row = {"d": d, "tokens": args.tokens, "label": v.label, "step_ms": 1e3 * s.median,
                   "iqr_ms": [1e3 * s.q25, 1e3 * s.q75], "matmul_tflops": flops / s.median / 1e12,
                   "fp8_linears": None if v.mp.fp8 is None else f"{len(v.mp.fp8.layers)} ({v.mp.fp8.backend})",
                   "speedup_vs_bf16_mixed": paired_ratio(samples[base][:n], samples[v.label][:n]) if n else None}
            doc["steps"].append(row)
            print(json.dumps(row), flush=True)
    return doc


def markdown(doc: dict) -> str:
    lines = ["| d | bf16 TFLOP/s | fp8 TFLOP/s | fp8 / bf16 |", "|---|---|---|---|"]
    for p in doc["peaks"]:
        fp8 = p.get("e4m3")
        fp8_cell = "-" if not fp8 else f"{fp8 / 1e12:.1f}"
        ratio_cell = "-" if not fp8 else f"{p['fp8_vs_bf16']:.2f}"
        lines.append(f"| {p['d']} | {p['bf16'] / 1e12:.1f} | {fp8_cell} | {ratio_cell} |")
    lines += ["", "| d | variant | step ms | MLP TFLOP/s | speedup vs bf16-mixed (median, 95% CI) |", "|---|---|---|---|---|"]
    for r in doc["steps"]:
        v = r["speedup_vs_bf16_mixed"]
        ratio = "-" if not v else f"{v['median']:.3f} ({v['ci95_low']:.3f}-{v['ci95_high']:.3f})"
        lines.append(f"| {r['d']} | {r['label']} | {r['step_ms']:.2f} | {r['matmul_tflops']:.1f} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--widths", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--compile", default="off", choices=("off", "on", "both"))
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--budget-s", type=float, default=None, help="stop the timed rounds after this many seconds")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    doc = run(args)
    print(markdown(doc))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
