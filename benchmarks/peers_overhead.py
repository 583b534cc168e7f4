"""One training iteration through mixprec, Hugging Face Accelerate and Lightning Fabric, against
the same iteration written by hand (torch.autocast + torch.amp.GradScaler): what each wrapper costs.

Every arm trains its own copy of the same model (same seed) on the same batches; the arms run
interleaved, one iteration each per round in a rotating order, and the ratio arm / hand is formed
per round (paired), so load that drifts over the run cancels. Accelerate and Fabric are timed when
installed (``pip install -e ".[transformers]"`` brings accelerate, ``".[lightning]"`` Fabric).

Arms: ``hand`` (the plain model), ``hand-prepared`` (the same hand loop on the model mixprec
prepared: what the prepared forward costs, apart from the step), ``mixprec`` (``mp.step``),
``accelerate``, ``fabric``. Each row says exactly what ran:

- the optimizer's implementation, read from each arm's optimizer object after a step (torch's
  CPU default ``AdamW()`` is the for-loop one; ``foreach=True`` and ``fused=True`` are the others);
- each arm's numerics, recorded in one probed iteration before the timing (the probes are removed
  again): the dtype of the model's floating input, of the residual stream (the first norm's input),
  of its matmuls (the first Linear's output) and of its output. A wrapper that silently ran another
  recipe (Accelerate's fp16 on a CPU runs fp32, Lightning's 16-mixed runs bf16) is marked so, and
  so is one whose numerics differ from the hand loop's (Fabric's bf16-mixed casts the inputs, so the
  residual stream runs in bf16).

    python benchmarks/peers_overhead.py              # the whole table (BENCHMARKS.md), JSON in benchmarks/results/
    python benchmarks/peers_overhead.py --models mlp gpt2 --recipes bf16-mixed fp16-mixed --threads 1 --rounds 200
    python benchmarks/peers_overhead.py --models tensors --tensors 10 100 1000   # how the step grows
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
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

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
DTYPES = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16, "fp32": None}
OPTIMIZERS = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
SHORT = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16", None: "-"}


def build(kind: str, tensors: int) -> tuple[nn.Module, Any, Any]:
    """A model, an input and a target: the block (compute-bound), a small MLP (overhead-bound), a
    tiny Hugging Face GPT-2 trained through ``labels=`` (the target is None), or a stack of tiny
    linears holding ``tensors`` parameter tensors (the step's per-tensor cost)."""
    g = torch.Generator().manual_seed(0)
    if kind == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=256, n_positions=64, resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        return GPT2LMHeadModel(cfg), torch.randint(0, 256, (4, 32), generator=g), None
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


def loss_of(out: Any, x: Any, y: Any, cast: bool) -> torch.Tensor:
    """The loss an arm computes: GPT-2's own (``labels=``, in fp32 inside HF), else MSE (on the
    outputs cast to fp32 where the arm does not get fp32 outputs already)."""
    if y is None:
        return out.loss
    return nn.functional.mse_loss(out.float() if cast else out, y)


def forward(model: nn.Module, x: Any, y: Any) -> Any:
    return model(x, labels=x) if y is None else model(x)


def optimizer_impl(opt: Any) -> str:
    """The implementation the optimizer object runs, read from it (unwrapping Accelerate's and
    Fabric's wrappers): "fused", "foreach" or "for-loop" (torch's choice when foreach is None)."""
    while not isinstance(opt, torch.optim.Optimizer) or type(opt).__module__.startswith(("accelerate", "lightning")):
        opt = opt.optimizer
    kinds = set()
    for group in opt.param_groups:
        if group.get("fused"):
            kinds.add("fused")
        elif group.get("foreach") is None:  # torch decides at step time, as it does here
            from torch.optim.optimizer import _default_to_fused_or_foreach

            _, foreach = _default_to_fused_or_foreach(group["params"], differentiable=False, use_fused=False)
            kinds.add("foreach" if foreach else "for-loop")
        else:
            kinds.add("foreach" if group["foreach"] else "for-loop")
    return "+".join(sorted(kinds))


class Numerics:
    """One probed iteration of an arm: the dtypes its model saw and made (hooks removed after)."""

    def __init__(self, model: nn.Module) -> None:
        self.seen: dict[str, torch.dtype | None] = {"in": None, "residual": None, "matmuls": None, "out": None}
        self.model = model

    def _set(self, key: str, t: Any) -> None:
        t = getattr(t, "logits", t)
        t = t[0] if isinstance(t, tuple) else t
        if self.seen[key] is None and isinstance(t, torch.Tensor) and t.is_floating_point():
            self.seen[key] = t.dtype

    def record(self, iteration: Any) -> dict[str, str]:
        m = self.model
        norm = next((x for x in m.modules() if "norm" in type(x).__name__.lower()), None)
        first = next(x for x in m.modules() if isinstance(x, (nn.Linear, nn.MultiheadAttention)) or
                     type(x).__name__ == "Conv1D")
        handles = [m.register_forward_pre_hook(lambda mod, a, kw: self._set("in", next(iter(a), None)), with_kwargs=True),
                   first.register_forward_hook(lambda mod, a, o: self._set("matmuls", o)),
                   m.register_forward_hook(lambda mod, a, o: self._set("out", o))]
        if norm is not None:
            handles.append(norm.register_forward_pre_hook(lambda mod, a: self._set("residual", a[0])))
        try:
            iteration()
        finally:
            for h in handles:
                h.remove()
        return {k: SHORT.get(v, str(v)) if v is not None else "ids" if k == "in" else "-" for k, v in self.seen.items()}


def arms(kind: str, tensors: int, recipe: str, optimizer: str) -> dict[str, Any]:
    """name -> (a zero-argument iteration (forward, backward, step) over its own model copy, the
    arm's model, its optimizer)."""
    dtype = DTYPES[recipe]
    out: dict[str, Any] = {}

    def fresh():
        torch.manual_seed(0)
        model, x, y = build(kind, tensors)
        return model, x, y, torch.optim.AdamW(model.parameters(), lr=1e-4, **OPTIMIZERS[optimizer])

    def hand_loop(model, x, y, opt):  # the seeds' fp16 loop; a disabled scaler for bf16 (nanoGPT's idiom)
        scaler = torch.amp.GradScaler("cpu", enabled=dtype is torch.float16)

        def hand():
            with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
                out_ = forward(model, x, y)
            scaler.scale(loss_of(out_, x, y, cast=True)).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
        return hand

    model, x, y, opt = fresh()
    out["hand"] = (hand_loop(model, x, y, opt), model, opt)

    model, x, y, opt = fresh()
    model = mixprec.MixedPrecision(recipe, "cpu").prepare(model)
    out["hand-prepared"] = (hand_loop(model, x, y, opt), model, opt)

    model, x, y, opt = fresh()
    mp = mixprec.MixedPrecision(recipe, "cpu")
    model = mp.prepare(model)

    def mixprec_arm(model=model, x=x, y=y, opt=opt, mp=mp):
        with mp.autocast():
            out_ = forward(model, x, y)
        mp.step(loss_of(out_, x, y, cast=False), opt, max_grad_norm=1.0)
    out["mixprec"] = (mixprec_arm, model, opt)

    with contextlib.suppress(ImportError):
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState

        # Accelerate keeps one state per process; a benchmark that changes the precision resets it
        # (a private method: this script only, never the library)
        AcceleratorState._reset_state(reset_partial_state=True)
        model, x, y, opt = fresh()
        inner = model
        acc = Accelerator(cpu=True, mixed_precision={"bf16-mixed": "bf16", "fp16-mixed": "fp16"}.get(recipe, "no"))
        model, opt = acc.prepare(model, opt)

        def accelerate_arm(model=model, x=x, y=y, opt=opt, acc=acc):
            with acc.autocast():
                out_ = forward(model, x, y)
            acc.backward(loss_of(out_, x, y, cast=True))
            acc.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        out["accelerate"] = (accelerate_arm, inner, opt)

    with contextlib.suppress(ImportError):
        from lightning.fabric import Fabric

        model, x, y, opt = fresh()
        inner = model
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Fabric's notes about CPU precision, measured below instead
            fabric = Fabric(accelerator="cpu", devices=1,
                            precision={"bf16-mixed": "bf16-mixed", "fp16-mixed": "16-mixed"}.get(recipe, "32-true"))
        model, opt = fabric.setup(model, opt)

        def fabric_arm(model=model, x=x, y=y, opt=opt, fabric=fabric):
            out_ = forward(model, x, y)
            fabric.backward(loss_of(out_, x, y, cast=True))
            fabric.clip_gradients(model, opt, max_norm=1.0, error_if_nonfinite=False)
            opt.step()
            opt.zero_grad(set_to_none=True)
        out["fabric"] = (fabric_arm, inner, opt)
    return out


def run(kind: str, tensors: int, recipe: str, optimizer: str, rounds: int, warmup: int) -> dict[str, Any]:
    fns = arms(kind, tensors, recipe, optimizer)
    numerics = {name: Numerics(model).record(fn) for name, (fn, model, _opt) in fns.items()}
    for _ in range(warmup):
        for fn, _model, _opt in fns.values():
            fn()
    times: dict[str, list[float]] = {n: [] for n in fns}
    for _r, name in interleaved_order(list(fns), rounds):
        fn = fns[name][0]
        t0 = time.perf_counter()
        fn()
        times[name].append(time.perf_counter() - t0)
    want = SHORT[DTYPES[recipe] or torch.float32]
    res = {"model": kind, "tensors": sum(1 for _ in build(kind, tensors)[0].parameters()), "recipe": recipe,
           "optimizer": optimizer, "threads": torch.get_num_threads(), "arms": {}}
    for name, (fn, _model, opt) in fns.items():
        res["arms"][name] = {
            "ms": Summary.of(times[name]).median * 1e3,
            "ratio_vs_hand": None if name == "hand" else paired_ratio(times[name], times["hand"]),
            "optimizer_impl": optimizer_impl(opt),
            "numerics": numerics[name],
            "ran_what_was_asked": numerics[name]["matmuls"] == want,
            # the same inputs, residual stream and matmuls as the hand loop (the output cast to fp32
            # is mixprec's policy; the hand loop casts the output in its loss instead)
            "numerics_as_hand": all(numerics[name][k] == numerics["hand"][k] for k in ("in", "residual", "matmuls")),
        }
    return res


def load() -> str:
    """The machine's load now (what ``uptime`` prints after "load average")."""
    try:
        one, five, fifteen = os.getloadavg()
        return f"{one:.2f}, {five:.2f}, {fifteen:.2f}"
    except OSError:
        return "?"


def cell(name: str, a: dict[str, Any]) -> str:
    ratio = a["ratio_vs_hand"]
    text = f"{a['ms']:.3g} ms" if ratio is None else f"{ratio['median']:.3f} ({ratio['ci95_low']:.3f}-{ratio['ci95_high']:.3f})"
    n = a["numerics"]
    text += f" [{a['optimizer_impl']}; in {n['in']}, residual {n['residual']}, matmuls {n['matmuls']}, out {n['out']}]"
    if not a["ran_what_was_asked"]:
        text += f" RAN {n['matmuls']}"
    elif not a["numerics_as_hand"]:
        text += " OTHER NUMERICS"
    return f"{name} {text}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["block", "mlp", "gpt2", "tensors"],
                    choices=("block", "mlp", "gpt2", "tensors"))
    ap.add_argument("--tensors", nargs="+", type=int, default=[10, 100, 1000], help="parameter tensors of 'tensors'")
    ap.add_argument("--recipes", nargs="+", default=["bf16-mixed", "fp16-mixed"], choices=tuple(DTYPES))
    ap.add_argument("--optimizer", nargs="+", default=["for-loop", "foreach", "fused"], choices=tuple(OPTIMIZERS),
                    help="AdamW's implementation: for-loop (torch's CPU default), foreach=True, fused=True")
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", default=None, help="default: benchmarks/results/peers_overhead_<date>.json")
    args = ap.parse_args(argv)
    env = environment("cpu")
    env["load_before"] = load()
    print(f"machine: {describe(env)}; load average {env['load_before']}")
    models = list(args.models)
    if "gpt2" in models:
        try:
            import transformers  # noqa: F401
        except ImportError:
            print("gpt2: skipped (transformers is not installed: pip install -e '.[transformers]')")
            models.remove("gpt2")
    results = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for kind in models:
            for n in (args.tensors if kind == "tensors" else [0]):
                for recipe in args.recipes:
                    for opt in args.optimizer:
                        r = run(kind, n, recipe, opt, args.rounds, args.warmup)
                        results.append(r)
                        label = f"{kind}{'/' + str(r['tensors']) if kind == 'tensors' else ''} {recipe} {threads}t"
                        print(f"{label}: " + " | ".join(cell(name, a) for name, a in r["arms"].items()), flush=True)
    env["load_after"] = load()
    print(f"load average after: {env['load_after']}")
    path = pathlib.Path(args.json or RESULTS / f"peers_overhead_{datetime.date.today().isoformat()}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"env": env, "argv": sys.argv[1:] if argv is None else argv, "results": results}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
