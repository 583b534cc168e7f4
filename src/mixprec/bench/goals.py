"""Issue 7's goals, checked against the JSON that ``mixprec bench`` writes. No torch needed.

Each check returns a row ``{"goal", "target", "measured", "met"}`` where ``met`` is True, False or
None (not measured, or the 95% interval of a ratio straddles the target: within noise), so a
summary can say what was missed and by how much.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

Doc = dict[str, Any]


def _by_label(doc: Doc | None) -> dict[str, Doc]:
    return {r["label"]: r for r in (doc or {}).get("results", []) if r.get("status") == "ok"}


def _row(goal: str, target: str, measured: str, met: bool | None) -> dict[str, Any]:
    return {"goal": goal, "target": target, "measured": measured, "met": met}


def speedup_goal(doc: Doc | None, label: str, target: float = 2.5) -> dict[str, Any]:
    r = _by_label(doc).get(label)
    s = (r or {}).get("speedup_vs_fp32")
    goal = f"{label} speedup over {s['baseline'] if s else 'fp32'} (TF32 off)"
    if not s:
        return _row(goal, f">= {target}x", "not measured", None)
    return _row(goal, f">= {target}x", f"{s['median']:.2f}x [IQR {s['q25']:.2f}-{s['q75']:.2f}]", s["median"] >= target)


def peak_goal(doc: Doc | None, label: str, target: float = 0.5) -> dict[str, Any]:
    r = _by_label(doc).get(label)
    goal = f"{label} fraction of the measured {r['peak_key'] if r else 'bf16'} matmul peak"
    if not r or r.get("peak_fraction") is None:
        return _row(goal, f">= {target:.0%}", "not measured", None)
    return _row(goal, f">= {target:.0%}", f"{r['peak_fraction']:.1%}", r["peak_fraction"] >= target)


def activation_goal(doc: Doc | None, label: str = "bf16-mixed", base: str = "fp32", target: float = 0.6) -> dict[str, Any]:
    res = _by_label(doc)
    a, b = (res.get(x, {}).get("memory") or {} for x in (label, base))
    goal = f"activation memory {label} / {base}"
    for key, how in (("cuda_forward_delta", "CUDA allocator"), ("saved_bytes", "saved for backward")):
        if a.get(key) and b.get(key):
            ratio = a[key] / b[key]
            return _row(goal, f"<= {target}x", f"{ratio:.3f}x ({how})", ratio <= target)
    return _row(goal, f"<= {target}x", "not measured", None)


def sync_goal(doc: Doc | None) -> dict[str, Any]:
    opt = (doc or {}).get("settings", {}).get("optimizer", "?")
    counts = {r["label"]: r["syncs_per_step"] for r in _by_label(doc).values() if r.get("syncs_per_step") is not None}
    goal = f"host syncs per step with {opt}"
    if not counts:
        return _row(goal, "0", "not measured (CUDA only)", None)
    worst = max(counts.values())
    detail = ", ".join(f"{k} {v:g}" for k, v in counts.items())
    return _row(goal, "0", detail, worst == 0 if "fused" in opt else None)


def overhead_goals(docs: Iterable[Doc | None], target: float = 1.02) -> list[dict[str, Any]]:
    rows = []
    for doc in docs:
        if not doc:
            continue
        shape = doc.get("shape", {}).get("name", "?")
        for run in doc.get("runs", []):
            goal = f"mixprec step / hand loop, {run.get('recipe')} {run.get('optimizer')} ({shape})"
            if run.get("status") != "ok":
                rows.append(_row(goal, f"<= {target}x", f"error: {run.get('error')}", None))
                continue
            r = run["ratio_iteration"]
            # judged on the 95% interval of the median ratio: a noisy run decides nothing
            met = True if r["ci95_high"] <= target else False if r["ci95_low"] > target else None
            rows.append(_row(goal, f"<= {target}x",
                             f"{r['median']:.3f}x (95% CI {r['ci95_low']:.3f}-{r['ci95_high']:.3f}), "
                             f"{run['extra_us_per_step']:+.0f} us/step", met))
    return rows


def all_goals(eager: Doc | None, compiled: Doc | None, overheads: Iterable[Doc | None]) -> list[dict[str, Any]]:
    """Every goal of issue 7 that these documents can answer."""
    return [
        speedup_goal(eager, "bf16-mixed"),
        speedup_goal(compiled, "bf16-mixed+compile"),
        peak_goal(compiled, "bf16-mixed+compile"),
        peak_goal(eager, "bf16-mixed"),
        activation_goal(eager),
        sync_goal(eager),
        *overhead_goals(overheads),
    ]


def verdict(row: dict[str, Any]) -> str:
    if row["met"] is None:
        return "-" if row["measured"].startswith(("not measured", "error")) else "within noise"
    return "met" if row["met"] else "MISSED"
