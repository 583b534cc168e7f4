"""What the NaN guard costs: step time with each guard mode relative to no guard, on several models.

For each model, identical copies (same seed) train side by side: no guard, ``trace="on-fault"``
(the cheap check per pass, ``MixedPrecision(nan_guard=True)``'s default) and ``trace="every-step"``
(the full trace). Rounds interleave the arms, the order rotated by one each round, so load from
other processes hits every arm alike; the ratio to the unguarded step is formed per round and
reported as its median with a 95% bootstrap interval. The machine load (``uptime``) is recorded
before and after. One command, one JSON:

    python benchmarks/guard_overhead.py                                 # gpt2, bert, llama at width 64
    python benchmarks/guard_overhead.py --models builtin gpt2 --width 256 --layers 4 --batch-size 8 --seq-len 128
    python benchmarks/guard_overhead.py --recipe bf16-mixed --device cuda --rounds 50
    python benchmarks/guard_overhead.py --arms off every-step --no-ops  # what one part of the full trace costs

``--models`` takes ``builtin`` (the built-in char GPT) and tiny Hugging Face models built from a
config (``gpt2 bert llama t5``; transformers installed, no download): 2 layers, width 64,
vocabulary 1000, random tokens, the model's own language-modelling loss.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

import mixprec
from mixprec.diagnostics._trace import hook_count
from mixprec.instruments.machine import environment
from mixprec.instruments.timing import Summary, interleaved_order, paired_ratio, synchronize
from mixprec.tasks import load_task, to_device

ARMS = ("off", "on-fault", "every-step")
RESULTS = Path(__file__).resolve().parent / "results"


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--models", nargs="+", default=["gpt2", "bert", "llama"],
                   choices=("builtin", "gpt2", "bert", "llama", "t5"))
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS, help="off is the baseline and always runs")
    p.add_argument("--recipe", default="fp32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--rounds", type=int, default=30, help="interleaved rounds (one step per arm each)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--threads", type=int, default=1, help="torch threads on the CPU (0: leave as is)")
    p.add_argument("--ops", action=argparse.BooleanOptionalAction, default=True,
                   help="every-step: nan_guard(ops=...): watch each torch call, not only module outputs")
    p.add_argument("--backward", action=argparse.BooleanOptionalAction, default=True,
                   help="every-step: nan_guard(backward=...): watch the gradients through each autograd node")
    p.add_argument("--locate", action=argparse.BooleanOptionalAction, default=True,
                   help="every-step: nan_guard(locate=...): note each op's source line")
    p.add_argument("--width", type=int, default=64, help="hidden size of the Hugging Face models (default 64)")
    p.add_argument("--layers", type=int, default=2, help="their layers (default 2)")
    p.add_argument("--profile", default=None, metavar="FILE", help="write a cProfile of the every-step arm here")
    p.add_argument("--src", default=None, metavar="DIR",
                   help="import mixprec from this src/ directory (time another checkout: a before/after)")
    p.add_argument("--json", default=str(RESULTS / "guard_overhead.json"), help="where the results go ('' for none)")
    args = p.parse_args(argv)
    if args.src:
        _use_src(args.src)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    arms = ["off"] + [a for a in args.arms if a != "off"]
    load_before = uptime()
    print(f"load before: {load_before}", file=sys.stderr)
    results = [run_model(m, arms, args, device) for m in args.models]
    out = {"machine": environment(device), "uptime_before": load_before, "uptime_after": uptime(),
           "args": vars(args), "results": results}
    print(f"\nrecipe {results[0]['recipe']} on {device}, B={args.batch_size} T={args.seq_len}, "
          f"{torch.get_num_threads()} thread(s), {args.rounds} interleaved rounds; ratio = median of per-round "
          "ratios to no guard (95% CI), wall clock, then this thread's CPU time")
    print("| model | size | off ms | " + " | ".join(f"{a} ms | {a} ratio | cpu ratio" for a in arms[1:]) + " | hooks |")
    print("|---|---|---|" + "---|---|---|" * (len(arms) - 1) + "---|")
    for r in results:
        cells = [f"{r['arms'][a]['ms']:.2f} | **{r['arms'][a]['ratio']['median']:.3f}** "
                 f"({r['arms'][a]['ratio']['ci95_low']:.3f}-{r['arms'][a]['ratio']['ci95_high']:.3f}) | "
                 f"{r['arms'][a]['cpu_ratio']['median']:.3f} ({r['arms'][a]['cpu_ratio']['ci95_low']:.3f}-"
                 f"{r['arms'][a]['cpu_ratio']['ci95_high']:.3f})" for a in arms[1:]]
        hooks = " / ".join(str(r["arms"][a]["hooks"]) for a in arms[1:])
        print(f"| {r['model']} | {r['size']} | {r['arms']['off']['ms']:.2f} | " + " | ".join(cells) + f" | {hooks} |")
    print(f"load after: {out['uptime_after']}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))
        print(f"wrote {args.json}")
    return out


def _knows_trace() -> bool:
    import inspect

    from mixprec.diagnostics.guard import NanGuard

    return "trace" in inspect.signature(NanGuard.__init__).parameters


def _use_src(src: str) -> None:
    """Re-import mixprec from ``src`` (this script imported the checkout it sits in)."""
    global mixprec, hook_count, environment, Summary, interleaved_order, paired_ratio, synchronize, load_task, to_device
    for name in [m for m in sys.modules if m == "mixprec" or m.startswith("mixprec.")]:
        del sys.modules[name]
    sys.path.insert(0, str(Path(src).resolve()))
    import mixprec as fresh

    if not Path(fresh.__file__).resolve().is_relative_to(Path(src).resolve()):
        raise SystemExit(f"imported mixprec from {fresh.__file__}, not from {src}")
    mixprec = fresh
    from mixprec.diagnostics._trace import hook_count
    from mixprec.instruments.machine import environment
    from mixprec.instruments.timing import Summary, interleaved_order, paired_ratio, synchronize
    from mixprec.tasks import load_task, to_device


def run_model(kind: str, arms: list[str], args: argparse.Namespace, device: torch.device) -> dict:
    task = load_task(None, batch_size=args.batch_size, seq_len=args.seq_len) if kind == "builtin" \
        else hf_task(kind, args.batch_size, args.seq_len, args.width, args.layers)
    sides = {}
    for arm in arms:
        torch.manual_seed(0)
        model = task.build_model().to(device)
        flag = False if arm == "off" else {"mode": "raise", "trace": arm, "ops": args.ops,
                                           "backward": args.backward, "locate": args.locate}
        if flag and not _knows_trace():
            del flag["trace"]  # a checkout from before trace= (--src): its flag guard is the full trace
        mp = mixprec.MixedPrecision(args.recipe, device, nan_guard=flag)
        mp.prepare(model)
        sides[arm] = (model, mp, task.build_optimizer(model.parameters()))

    def step(arm: str, i: int) -> tuple[float, float]:
        model, mp, opt = sides[arm]
        inputs, targets = to_device(task.get_batch(i), device)
        synchronize(device)
        t0, c0 = time.perf_counter(), time.thread_time()
        with mp.autocast():
            loss = task.loss_fn(task.run_forward(model, inputs), targets)
        mp.step(loss, opt, max_grad_norm=task.max_grad_norm)
        synchronize(device)
        return time.perf_counter() - t0, time.thread_time() - c0

    for i in range(args.warmup):
        for arm in arms:
            step(arm, i)
    profiler = None
    if args.profile and "every-step" in arms:
        import cProfile

        profiler = cProfile.Profile()
    times: dict[str, list[float]] = {a: [] for a in arms}
    cpu: dict[str, list[float]] = {a: [] for a in arms}  # this thread's CPU time: what other processes' load moves least
    for rnd, arm in interleaved_order(arms, args.rounds):
        if profiler is not None and arm == "every-step":
            profiler.enable()
        wall, used = step(arm, args.warmup + rnd)
        times[arm].append(wall)
        cpu[arm].append(used)
        if profiler is not None and arm == "every-step":
            profiler.disable()
    if profiler is not None:
        profiler.dump_stats(args.profile)
    res = {"model": kind, "recipe": mixprec.resolve_recipe(args.recipe, device).name,
           "size": f"B{args.batch_size} T{args.seq_len}" + ("" if kind == "builtin" else f" d{args.width} L{args.layers}"),
           "arms": {}, "samples_s": times, "cpu_samples_s": cpu}
    for arm in arms:
        model, mp, _ = sides[arm]
        res["arms"][arm] = {
            "ms": 1e3 * Summary.of(times[arm]).median, "ratio": paired_ratio(times[arm], times["off"]),
            "cpu_ratio": paired_ratio(cpu[arm], cpu["off"]),
            "hooks": hook_count(model), "checks": 0 if mp.guard is None else mp.guard.checks,
            "events": 0 if mp.guard is None else len(mp.guard.events),
            "replays": getattr(mp.guard, "replays", 0),
        }
    print(f"{kind}: " + ", ".join(f"{a} {res['arms'][a]['ratio']['median']:.3f}" for a in arms[1:]), file=sys.stderr)
    return res


def hf_task(kind: str, batch: int, seq: int, width: int = 64, layers: int = 2) -> mixprec.Task:
    """A tiny Hugging Face model (from a config, random init) and random token batches."""
    import transformers as tf

    common = {"vocab_size": 1000}
    if kind == "gpt2":
        config, cls = tf.GPT2Config(n_layer=layers, n_embd=width, n_head=4, n_positions=seq, **common), tf.GPT2LMHeadModel
    elif kind == "bert":
        config, cls = tf.BertConfig(num_hidden_layers=layers, hidden_size=width, num_attention_heads=4,
                                    intermediate_size=4 * width, max_position_embeddings=seq, **common), tf.BertForMaskedLM
    elif kind == "llama":
        config, cls = tf.LlamaConfig(num_hidden_layers=layers, hidden_size=width, num_attention_heads=4,
                                     num_key_value_heads=4, intermediate_size=4 * width, max_position_embeddings=seq, **common), tf.LlamaForCausalLM
    else:
        config, cls = tf.T5Config(num_layers=layers, d_model=width, num_heads=4, d_kv=width // 4, d_ff=4 * width,
                                 decoder_start_token_id=0, pad_token_id=0, **common), \
            tf.T5ForConditionalGeneration

    def get_batch(step: int):
        ids = torch.randint(0, 1000, (batch, seq), generator=torch.Generator().manual_seed(step))
        return ids, ids

    def run_forward(model, ids):
        return model(input_ids=ids, labels=ids).loss

    return mixprec.Task(name=kind, build_model=lambda: cls(config), get_batch=get_batch,
                        loss_fn=lambda loss, _targets: loss, forward=run_forward, steps=1,
                        description=f"tiny {kind} (transformers, from a config)")


if __name__ == "__main__":
    main()
