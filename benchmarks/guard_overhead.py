"""What the NaN guard costs: step time with ``MixedPrecision(nan_guard=True)`` relative to off.

Two identical models (same seed) train on the built-in task; their steps are interleaved
(off, on, off, on, ...) so load from other processes hits both alike. Prints the median step time
of each, the ratio (the target is under 1.5x), and the hooks each model carries: exactly zero
when the guard is off (for recipes that add none themselves, such as fp32).

    python benchmarks/guard_overhead.py                     # fp32 on the CPU
    python benchmarks/guard_overhead.py --recipe bf16-mixed --device cuda --steps 50
    python benchmarks/guard_overhead.py --model gpt2 --batch-size 4 --seq-len 32   # a tiny Hugging Face model

``--model gpt2|bert|llama|t5`` builds a small Hugging Face model from a config (transformers
installed; no download): 2 layers, width 64, vocabulary 1000, trained on random tokens with the
model's own language-modelling loss (``--width``/``--layers`` for another size).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import mixprec
from mixprec.diagnostics._trace import hook_count
from mixprec.tasks import load_task, to_device


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="fp32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=20, help="timed steps per side")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=0, help="torch threads on the CPU (0: leave as is)")
    p.add_argument("--ops", action=argparse.BooleanOptionalAction, default=True,
                   help="nan_guard(ops=...): watch each torch call, not only module outputs")
    p.add_argument("--backward", action=argparse.BooleanOptionalAction, default=True,
                   help="nan_guard(backward=...): watch the gradients through each autograd node")
    p.add_argument("--locate", action=argparse.BooleanOptionalAction, default=True,
                   help="nan_guard(locate=...): note each op's source line")
    p.add_argument("--model", default="builtin", choices=("builtin", "gpt2", "bert", "llama", "t5"),
                   help="the built-in char GPT, or a tiny Hugging Face model built from a config")
    p.add_argument("--width", type=int, default=64, help="--model: hidden size (default 64)")
    p.add_argument("--layers", type=int, default=2, help="--model: layers (default 2)")
    p.add_argument("--profile", default=None, metavar="FILE", help="write a cProfile of the guarded steps here")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    task = load_task(None, batch_size=args.batch_size, seq_len=args.seq_len) if args.model == "builtin" \
        else hf_task(args.model, args.batch_size, args.seq_len, args.width, args.layers)

    sides = {}
    for guarded in (False, True):
        torch.manual_seed(0)
        model = task.build_model().to(device)
        guard = {"mode": "raise", "ops": args.ops, "backward": args.backward, "locate": args.locate}
        mp = mixprec.MixedPrecision(args.recipe, device, nan_guard=guard if guarded else False)
        mp.prepare(model)
        sides[guarded] = (model, mp, task.build_optimizer(model.parameters()), [])

    def step(guarded: bool, i: int) -> float:
        model, mp, opt, _ = sides[guarded]
        inputs, targets = to_device(task.get_batch(i), device)
        _sync(device)
        t0 = time.perf_counter()
        with mp.autocast():
            loss = task.loss_fn(task.run_forward(model, inputs), targets)
        mp.step(loss, opt, max_grad_norm=task.max_grad_norm)
        _sync(device)
        return time.perf_counter() - t0

    profiler = None
    for i in range(args.warmup + args.steps):
        for guarded in (False, True):
            if guarded and args.profile and i == args.warmup:
                import cProfile

                profiler = cProfile.Profile()
            if guarded and profiler is not None:
                profiler.enable()
            dt = step(guarded, i)
            if guarded and profiler is not None:
                profiler.disable()
            if i >= args.warmup:
                sides[guarded][3].append(dt)
    if profiler is not None:
        profiler.dump_stats(args.profile)
    off = statistics.median(sides[False][3])
    on = statistics.median(sides[True][3])
    result = {
        "model": args.model, "recipe": mixprec.resolve_recipe(args.recipe, device).name, "device": str(device),
        "batch_size": args.batch_size, "seq_len": args.seq_len, "threads": torch.get_num_threads(),
        "guard_options": {"ops": args.ops, "backward": args.backward, "locate": args.locate},
        "steps": args.steps, "off_ms": off * 1e3, "on_ms": on * 1e3, "ratio": on / off,
        "hooks_off": hook_count(sides[False][0]), "hooks_on": hook_count(sides[True][0]),
        "guard_checks": sides[True][1].guard.checks, "guard_events": len(sides[True][1].guard.events),
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{args.model} task, recipe {result['recipe']} on {device}, B={args.batch_size} T={args.seq_len}, "
              f"{result['threads']} thread(s), median of {args.steps} interleaved steps")
        print(f"  guard off: {off * 1e3:8.2f} ms/step   hooks on the model: {result['hooks_off']}")
        opts = ", ".join(f"{k}={v}" for k, v in result["guard_options"].items())
        print(f"  guard on:  {on * 1e3:8.2f} ms/step   ({opts})")
        print(f"             hooks on the model: {result['hooks_on']}   "
              f"checks: {result['guard_checks']} (host syncs), events: {result['guard_events']}")
        print(f"  ratio on/off: {result['ratio']:.2f}x  (target < 1.5x)")
    return result


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
        if kind == "t5":
            return model(input_ids=ids, labels=ids).loss
        return model(input_ids=ids, labels=ids).loss

    return mixprec.Task(name=kind, build_model=lambda: cls(config), get_batch=get_batch,
                        loss_fn=lambda loss, _targets: loss, forward=run_forward, steps=1,
                        description=f"tiny {kind} (transformers, from a config)")


if __name__ == "__main__":
    main()
