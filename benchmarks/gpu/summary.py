"""Print the short table that ends benchmarks/gpu/run.sh, and write it to OUT/summary.md.

    python benchmarks/gpu/summary.py OUT_DIR

Reads what the parts left in OUT_DIR (bench_eager.json, compile_main.json, compile_more.json,
overhead.json, overhead_ref.json, masters_step.json, run.log; with PARTS=fp8, fp8_linear.json and
fp8_block.json); a missing file just leaves its rows out.
"""

from __future__ import annotations

import json
import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "src"))

from mixprec.bench import goals, tables  # noqa: E402


def _load(out: pathlib.Path, name: str) -> dict | None:
    path = out / name
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def summarize(out: pathlib.Path) -> str:
    eager = _load(out, "bench_eager.json")
    compiled = _load(out, "compile_main.json")
    more = _load(out, "compile_more.json")
    overheads = [_load(out, "overhead.json"), _load(out, "overhead_ref.json")]
    lines = ["# Benchmark summary", ""]
    fp8_linear, fp8_block = _load(out, "fp8_linear.json"), _load(out, "fp8_block.json")
    env = next((d["env"] for d in (eager, compiled, more, *overheads, fp8_block, fp8_linear) if d), None)
    if env:
        lines.append(f"{env.get('device_name')} | torch {env['torch']} | CUDA {env.get('cuda')} | {env['date']}")
        lines.append("")
    log = out / "run.log"
    if log.exists():
        parts = re.findall(r"^--- (\S+): (rc=\d+ in \d+s.*|skipped.*)$", log.read_text(errors="replace"), re.M)
        lines += ["parts: " + "; ".join(f"{name} {status}" for name, status in parts), ""]
    for title, doc in (("eager", eager), ("torch.compile (fp32, bf16-mixed)", compiled), ("torch.compile (all)", more),
                       ("fp8 recipes on the reference block", fp8_block)):
        if doc:
            s = doc["shape"]
            lines += [f"## {title}: d={s['d_model']} B={s['batch']} T={s['seq']}, {doc['settings']['optimizer']}, "
                      f"{doc['flops']['step']:.3g} FLOP/step", "", tables.markdown_table(*tables.compact_rows(doc)), ""]
    if eager and eager.get("peaks"):
        lines += [tables.markdown_table(*tables.peak_rows(eager)), ""]
    for doc in overheads:
        if doc:
            lines += [f"## step overhead, shape {doc['shape']['name']}", "", tables.markdown_table(*tables.overhead_rows(doc)), ""]
    masters = _load(out, "masters_step.json")
    if masters:
        a = masters["args"]
        rows = [[r["recipe"], str(r["tensors"]), f"{r['step_ms']:.3f}",
                 f"{r['vs_bf16_mixed']['median']:.3f} ({r['vs_bf16_mixed']['ci95_low']:.3f}-{r['vs_bf16_mixed']['ci95_high']:.3f})",
                 f"{r['masters_ms']:.3f}", "-" if r["masters_us_per_tensor"] is None else f"{r['masters_us_per_tensor']:.1f}"]
                for r in masters["rows"]]
        lines += [f"## master-weight step work: {a['layers']} x Linear({a['width']}, {a['width']}), batch {a['batch']}", "",
                  tables.markdown_table(["recipe", "16-bit tensors", "step ms", "vs bf16-mixed (95% CI)", "masters ms/step",
                                         "us/tensor"], rows), ""]
    if fp8_block and fp8_block.get("peaks"):
        lines += [tables.markdown_table(*tables.peak_rows(fp8_block)), ""]
    if fp8_linear:
        lines += ["## fp8 on large linears (MLP d -> 4d -> d)", "", _fp8_linear_markdown(fp8_linear), ""]
    issue7 = eager or compiled or any(overheads)  # (a PARTS=fp8 run answers none of them)
    rows = [[g["goal"], g["target"], g["measured"], goals.verdict(g)]
            for g in goals.all_goals(eager, compiled, overheads)] if issue7 else []
    if fp8_linear:
        rows.append(_fp8_gemm_goal(fp8_linear))
    lines += ["## goals", "", tables.markdown_table(["goal", "target", "measured", "verdict"], rows)]
    return "\n".join(lines) + "\n"


def _fp8_linear_markdown(doc: dict) -> str:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    from fp8_linear import markdown  # benchmarks/fp8_linear.py

    return markdown(doc)


def _fp8_gemm_goal(doc: dict) -> list[str]:
    """Issue 15: fp8 GEMMs >= 1.6x bf16 at 8192 wide."""
    peak = next((p for p in doc["peaks"] if p["d"] == 8192), None)
    ratio = None if peak is None else peak.get("fp8_vs_bf16")
    measured = "not measured" if ratio is None else f"{ratio:.2f}x"
    return ["fp8 GEMM over bf16 at 8192 (_scaled_mm)", ">= 1.6x", measured,
            "-" if ratio is None else "met" if ratio >= 1.6 else "MISSED"]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python benchmarks/gpu/summary.py OUT_DIR", file=sys.stderr)
        return 2
    out = pathlib.Path(argv[0])
    text = summarize(out)
    (out / "summary.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
