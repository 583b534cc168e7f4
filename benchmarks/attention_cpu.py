"""What attention costs a bf16 step on the CPU, and the fp32-attention workaround.

On CPUs with AMX (Intel Sapphire Rapids and later) bf16 matmuls run several times faster than
fp32 ones, yet the reference block under ``bf16-mixed`` gains far less than its matmuls would
suggest. This script times, in interleaved rounds on the CPU shape of ``mixprec bench``
(d=256, 4 heads, B=4, T=128):

1. ``F.scaled_dot_product_attention`` alone, forward + backward, on fp32 and on bf16 inputs;
2. the block's training step under ``fp32``, under ``bf16-mixed``, and under ``bf16-mixed`` with
   the attention core kept in fp32 by mixprec's own rule (``fp32_modules=["AttentionCore"]``:
   the module runs outside autocast on fp32 inputs, its output goes back to bf16).

    python benchmarks/attention_cpu.py --threads 1 --rounds 20
    python benchmarks/attention_cpu.py --threads 2 --json attention.json

Ratios are per round (same round, same load) with a 95% bootstrap interval of the median.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import mixprec  # noqa: E402
from mixprec.bench.block import RefBlock, get_shape, loss_fn, make_batches  # noqa: E402
from mixprec.islands import island_names  # noqa: E402
from mixprec.instruments.machine import describe, environment  # noqa: E402
from mixprec.instruments.timing import Summary, paired_ratio  # noqa: E402


class AttentionCore(nn.Module):
    """The attention product as a module, so that a recipe's ``fp32_modules`` rule can name it."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v)


class Block(RefBlock):
    """``RefBlock`` with its attention product in an ``AttentionCore`` submodule (same numbers)."""

    def __init__(self, shape) -> None:
        super().__init__(shape)
        self.core = AttentionCore()

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.core(q, k, v)


def _sdpa_arm(shape, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    size = (shape.batch, shape.n_head, shape.seq, shape.d_model // shape.n_head)
    qkv = [torch.randn(size, generator=g).to(dtype).requires_grad_() for _ in range(3)]
    grad = torch.randn(size, generator=g).to(dtype)

    def run() -> None:
        out = F.scaled_dot_product_attention(*qkv)
        out.backward(grad)
        for t in qkv:
            t.grad = None

    return run


def _step_arm(shape, recipe: str, fp32_attention: bool):
    torch.manual_seed(0)
    model = Block(shape)
    mp = mixprec.MixedPrecision(recipe, device="cpu", fp32_modules=["AttentionCore"] if fp32_attention else ())
    model = mp.prepare(model)
    if fp32_attention and "core" not in island_names(model):
        raise RuntimeError(f"the attention core is not an fp32 island: {island_names(model)}")
    opt = torch.optim.AdamW(mp.parameters(model), lr=1e-4, foreach=True)
    batches = make_batches(shape, "cpu")
    state = {"i": 0}

    def run() -> None:
        x, y = batches[state["i"] % len(batches)]
        state["i"] += 1
        with mp.autocast():
            loss = loss_fn(model(x), y)
        mp.step(loss, opt, max_grad_norm=1.0)

    return run


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--rounds", type=int, default=20, help="interleaved rounds (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls of each arm first (default 3)")
    p.add_argument("--json", default=None, metavar="PATH", help="write every sample and the ratios here")
    args = p.parse_args(argv)
    if args.rounds < 2 or args.warmup < 0 or args.threads < 1:
        p.error("--rounds must be >= 2, --warmup >= 0 and --threads >= 1")
    torch.set_num_threads(args.threads)
    shape = get_shape("cpu")
    env = environment("cpu")
    env["command"] = "benchmarks/attention_cpu.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(describe(env), flush=True)

    arms = {
        "sdpa fp32": _sdpa_arm(shape, torch.float32),
        "sdpa bf16": _sdpa_arm(shape, torch.bfloat16),
        "step fp32": _step_arm(shape, "fp32", False),
        "step bf16-mixed": _step_arm(shape, "bf16-mixed", False),
        "step bf16-mixed, fp32 attention": _step_arm(shape, "bf16-mixed", True),
    }
    for run in arms.values():
        for _ in range(args.warmup):
            run()
    samples: dict[str, list[float]] = {k: [] for k in arms}
    names = list(arms)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:  # rotate the order each round
            t0 = time.perf_counter()
            arms[name]()
            samples[name].append(time.perf_counter() - t0)
        print(f"\rround {r + 1}/{args.rounds}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)

    med = {k: Summary.of(v).median for k, v in samples.items()}
    ratios = {
        "sdpa bf16 / fp32 (time)": paired_ratio(samples["sdpa bf16"], samples["sdpa fp32"]),
        "bf16-mixed speedup over fp32": paired_ratio(samples["step fp32"], samples["step bf16-mixed"]),
        "bf16-mixed + fp32 attention speedup over fp32": paired_ratio(samples["step fp32"],
                                                                      samples["step bf16-mixed, fp32 attention"]),
        "bf16-mixed + fp32 attention speedup over bf16-mixed": paired_ratio(samples["step bf16-mixed"],
                                                                            samples["step bf16-mixed, fp32 attention"]),
    }
    print("\n| arm | median ms |\n|---|---|")
    for k, v in med.items():
        print(f"| {k} | {v * 1e3:.2f} |")
    print("\n| ratio | median (95% CI) |\n|---|---|")
    for k, r in ratios.items():
        print(f"| {k} | {r['median']:.2f} ({r['ci95_low']:.2f}-{r['ci95_high']:.2f}) |")
    share = (med["sdpa bf16"]) / med["step bf16-mixed"]
    print(f"\nattention forward+backward in bf16 is {share:.0%} of the bf16-mixed step "
          f"(fp32 attention: {med['sdpa fp32'] / med['step fp32']:.0%} of the fp32 step)")
    result = {"env": env, "shape": shape.name, "rounds": args.rounds, "samples_s": samples,
              "median_s": med, "ratios": ratios}
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
