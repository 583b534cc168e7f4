"""The fp8 weight cast cached across the micro-batches of an accumulation window: what it saves.

    python benchmarks/fp8_weight_cache.py --json benchmarks/results/fp8_weight_cache_cpu.json
    python benchmarks/fp8_weight_cache.py --device cuda --d 4096 --tokens 4096      # where one is lent

One optimizer step of an MLP ``d -> 4d -> d`` (both linears in fp8) trained with ``accumulate``
micro-batches of ``tokens`` tokens, under fp8-current and fp8-delayed, with ``cache_weight`` on and
off; the four arms are timed interleaved, round by round, and each cache-on arm is paired with its
cache-off arm of the same round (ratio < 1: the cache is faster). The weight is cast once per window
instead of once per micro-batch; what that saves is the cast's share of a micro-batch (small when
the GEMMs dominate, larger on small token counts). The first run checks the arms agree bit for bit.
"""

from __future__ import annotations

import argparse
import json
import subprocess
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


class Mlp(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Arm:
    def __init__(self, recipe: str, cache: bool, args: argparse.Namespace, device: torch.device) -> None:
        self.label = f"{recipe} cache={'on' if cache else 'off'}"
        self.mp = MixedPrecision(recipe, device, accumulate=args.accumulate,
                                 fp8={"skip_first_last": False, "cache_weight": cache})
        torch.manual_seed(0)
        self.model = self.mp.prepare(Mlp(args.d).to(device))
        self.opt = torch.optim.AdamW(self.mp.parameters(self.model), lr=1e-4)
        g = torch.Generator().manual_seed(1)
        self.xs = [torch.randn(args.tokens, args.d, generator=g).to(device) for _ in range(args.accumulate)]

    def window(self) -> float:
        for x in self.xs:
            with self.mp.autocast():
                out = self.model(x)
            loss = self.mp.step(out.float().square().mean(), self.opt).loss
        return float(loss)


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    arms = [Arm(r, c, args, device) for r in ("fp8-current", "fp8-delayed") for c in (True, False)]
    losses = {a.label: [a.window() for _ in range(2)] for a in arms}  # warm-up, and the bitwise check
    for r in ("fp8-current", "fp8-delayed"):
        on, off = losses[f"{r} cache=on"], losses[f"{r} cache=off"]
        if on != off:
            raise SystemExit(f"{r}: the cached run differs from the uncached one: {on} vs {off}")
    synchronize(device)
    samples: dict[str, list[float]] = {a.label: [] for a in arms}
    by_label = {a.label: a for a in arms}
    t0 = time.perf_counter()
    for _, label in interleaved_order(list(samples), args.rounds):
        samples[label].append(time_call(by_label[label].window, device, 1))
    rows = []
    for r in ("fp8-current", "fp8-delayed"):
        on, off = samples[f"{r} cache=on"], samples[f"{r} cache=off"]
        rows.append({"recipe": r, "window_ms_on": 1e3 * Summary.of(on).median, "window_ms_off": 1e3 * Summary.of(off).median,
                     "on_over_off": paired_ratio(on, off)})
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    return {"kind": "mixprec-fp8-weight-cache", "env": environment(device), "args": vars(args), "rows": rows,
            "bitwise_same": True, "uptime": load, "timed_s": time.perf_counter() - t0}


def markdown(doc: dict) -> str:
    a = doc["args"]
    lines = [f"MLP d={a['d']}, {a['tokens']} tokens x {a['accumulate']} micro-batches, {a['rounds']} interleaved rounds "
             f"({doc['uptime']})", "",
             "| recipe | window ms, cache on | cache off | on / off (median, 95% CI) |", "|---|---|---|---|"]
    for r in doc["rows"]:
        q = r["on_over_off"]
        lines.append(f"| {r['recipe']} | {r['window_ms_on']:.1f} | {r['window_ms_off']:.1f} | "
                     f"{q['median']:.3f} ({q['ci95_low']:.3f}-{q['ci95_high']:.3f}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--accumulate", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    doc = run(args)
    print(markdown(doc))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
