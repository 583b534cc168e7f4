"""`mixprec lint` on real training code: precision and recall per rule, and time per repository.

The corpus is public repositories (``lint_corpus/manifest.json``: repository, commit, the paths
taken, the kind of training code, and whether it was used to tune the rules or held out). Their
code is never committed here: ``extract`` copies the Python files of each repository at its commit
from local git snapshots into a corpus directory outside the checkout. ``lint_corpus/judgements.json``
holds, per repository, the real traps found by reading the code (``traps``: path, line, code;
``lines`` when a finding may rightly sit on more than one) and the findings judged false
(``false``: path, line, code, why). A finding that matches a trap is a true positive, one in
``false`` a false positive, any other is reported as unjudged (and counted as neither).

    python benchmarks/lint_corpus.py extract --mirror /work/.mirror --corpus /work/lintcorpus/src
    python benchmarks/lint_corpus.py measure --corpus /work/lintcorpus/src [--split heldout]
    python benchmarks/lint_corpus.py findings --corpus /work/lintcorpus/src --repo ultralytics/yolov5
    python benchmarks/lint_corpus.py timing --corpus /work/lintcorpus/src

``measure`` prints per rule and split: findings, true / false positives, precision, traps and
caught traps, recall; the time of each repository (CPU and wall seconds, files); and writes
benchmarks/results/lint_corpus.json. MP201 (deprecated API) findings are judged by their text:
a true positive when the reported line names ``torch.cuda.amp`` / ``torch.cpu.amp`` or a name the
file imports from them; they are counted apart from the MP1xx rules.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from mixprec.lint import lint_paths  # noqa: E402
from mixprec.lint.rules import RULES  # noqa: E402

MANIFEST = HERE / "lint_corpus" / "manifest.json"
JUDGEMENTS = HERE / "lint_corpus" / "judgements.json"
RESULTS = HERE / "results" / "lint_corpus.json"


def _entries(split: str | None = None, repo: str | None = None) -> list[dict]:
    entries = json.loads(MANIFEST.read_text())["repositories"]
    return [e for e in entries if (split in (None, "all", e["split"])) and (repo is None or e["repo"] == repo)]


def _local(repo: str) -> str:
    return repo.replace("/", "+")


def _wanted(path: str, entry: dict) -> bool:
    """A Python file under one of the entry's ``include`` prefixes, in no directory named in
    its ``exclude`` (tests, docs)."""
    if not path.endswith(".py") or not any(path.startswith(p) for p in entry["include"]):
        return False
    return not set(path.split("/")[:-1]) & {x.strip("/") for x in entry["exclude"]}


def extract(mirror: Path, corpus: Path) -> None:
    for entry in _entries():
        base = mirror / _local(entry["repo"]) / "repo"
        git = base / ".git" if (base / ".git").is_dir() else base
        names = subprocess.run(
            ["git", "-C", str(git), "ls-tree", "-r", "--name-only", entry["commit"]],
            capture_output=True, text=True, check=True,
        ).stdout.splitlines()
        names = [n for n in names if _wanted(n, entry)]
        out = corpus / _local(entry["repo"])
        archive = subprocess.run(
            ["git", "-C", str(git), "archive", "--format=tar", entry["commit"], "--", *names],
            capture_output=True, check=True,
        ).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(out, filter="data")
        print(f"{entry['repo']:55} {len(names):5} files")


# --- judging -----------------------------------------------------------------------------------

_DEPRECATED = re.compile(r"\b(?:cuda|cpu)\s*\.\s*amp\b")


def _mp201_true(root: Path, finding) -> bool:
    text = (root / finding.path).read_text(encoding="utf-8", errors="replace")
    lines = text.splitlines()
    line = lines[finding.line - 1] if finding.line <= len(lines) else ""
    if _DEPRECATED.search(line):
        return True
    imported = set()
    for match in re.finditer(r"from\s+torch\.(?:cuda|cpu)\.amp(?:\.\w+)?\s+import\s+\(?([\w\s,]+)\)?", text):
        imported.update(w.split(" as ")[-1].strip() for w in match.group(1).split(","))
    modules = set()  # from torch.cuda import amp; import torch.cuda.amp as amp
    for match in re.finditer(r"from\s+torch\s*\.\s*(?:cuda|cpu)\s+import\s+amp(?:\s+as\s+(\w+))?", text):
        modules.add(match.group(1) or "amp")
    for match in re.finditer(r"import\s+torch\.(?:cuda|cpu)\.amp\s+as\s+(\w+)", text):
        modules.add(match.group(1))
    if any(re.search(rf"\b{re.escape(m)}\s*\.", line) for m in modules):
        return True
    return any(re.search(rf"\b{re.escape(name)}\b", line) for name in imported if name)


def lint_repo(corpus: Path, entry: dict):
    root = corpus / _local(entry["repo"])
    cwd = os.getcwd()
    os.chdir(root)  # paths in findings relative to the repository
    try:
        wall, cpu = time.perf_counter(), time.process_time()
        result = lint_paths(["."])
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        os.chdir(cwd)
    for f in result.findings:
        object.__setattr__(f, "path", os.path.normpath(f.path))
    return root, result, wall, cpu


def judge(corpus: Path, entries: list[dict]) -> dict:
    judgements = json.loads(JUDGEMENTS.read_text()) if JUDGEMENTS.exists() else {}
    rows, times, unjudged, missed = [], [], [], []
    for entry in entries:
        root, result, wall, cpu = lint_repo(corpus, entry)
        times.append({"repo": entry["repo"], "files": result.files, "cpu_s": round(cpu, 3), "wall_s": round(wall, 3)})
        j = judgements.get(entry["repo"], {})
        traps = j.get("traps", [])
        false = {(x["path"], x["line"], x["code"]) for x in j.get("false", [])}
        caught = set()
        for f in result.findings:
            if f.code == "MP000":
                verdict = "error"
            elif f.code == "MP201":
                verdict = "tp" if _mp201_true(root, f) else "fp"
            else:
                match = [i for i, t in enumerate(traps) if t["code"] == f.code and t["path"] == f.path
                         and f.line in t.get("lines", [t["line"]])]
                if match:
                    caught.update(match)
                    verdict = "tp"
                elif (f.path, f.line, f.code) in false:
                    verdict = "fp"
                else:
                    verdict = "unjudged"
                    unjudged.append({"repo": entry["repo"], "path": f.path, "line": f.line, "code": f.code,
                                     "message": f.message})
            rows.append({"repo": entry["repo"], "split": entry["split"], "code": f.code, "verdict": verdict})
        for i, t in enumerate(traps):
            rows.append({"repo": entry["repo"], "split": entry["split"], "code": t["code"],
                         "verdict": "trap_caught" if i in caught else "trap_missed"})
            if i not in caught:
                missed.append({"repo": entry["repo"], **t})
    return {"rows": rows, "times": times, "unjudged": unjudged, "missed": missed}


def table(rows: list[dict]) -> list[dict]:
    per: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for r in rows:
        per[r["code"]][r["verdict"]] += 1
        group = "MP201" if r["code"] == "MP201" else "MP1xx (all)"
        if r["code"] != "MP201":
            per[group][r["verdict"]] += 1
    out = []
    for code in sorted(per, key=lambda c: (c.startswith("MP1xx"), c)):
        c = per[code]
        tp, fp = c["tp"], c["fp"]
        traps = c["trap_caught"] + c["trap_missed"]
        out.append({
            "code": code, "name": RULES[code].name if code in RULES else "", "findings": tp + fp + c["unjudged"] + c["error"],
            "tp": tp, "fp": fp, "unjudged": c["unjudged"], "precision": round(tp / (tp + fp), 3) if tp + fp else None,
            "traps": traps, "caught": c["trap_caught"], "recall": round(c["trap_caught"] / traps, 3) if traps else None,
        })
    return out


def _print_table(title: str, lines: list[dict]) -> None:
    print(f"\n{title}")
    print(f"{'code':12} {'name':32} {'found':>5} {'TP':>4} {'FP':>4} {'?':>3} {'prec':>6} {'traps':>5} {'caught':>6} {'recall':>6}")
    for r in lines:
        prec = "-" if r["precision"] is None else f"{r['precision']:.0%}"
        rec = "-" if r["recall"] is None else f"{r['recall']:.0%}"
        print(f"{r['code']:12} {r['name'][:32]:32} {r['findings']:5} {r['tp']:4} {r['fp']:4} {r['unjudged']:3} "
              f"{prec:>6} {r['traps']:5} {r['caught']:6} {rec:>6}")


def measure(corpus: Path, split: str, out: Path | None) -> int:
    entries = _entries(split)
    report = judge(corpus, entries)
    result = {"split": split, "machine_load": os.getloadavg(), "splits": {}}
    for name in sorted({e["split"] for e in entries}):
        lines = table([r for r in report["rows"] if r["split"] == name])
        result["splits"][name] = lines
        repos = [e for e in entries if e["split"] == name]
        kinds = sorted({e["kind"] for e in repos})
        _print_table(f"{name}: {len(repos)} repositories ({', '.join(kinds)})", lines)
    times = sorted(report["times"], key=lambda t: -t["cpu_s"])
    result["times"] = times
    print("\nslowest repositories (CPU s, wall s, files):")
    for t in times[:8]:
        print(f"  {t['repo']:55} {t['cpu_s']:7.2f} {t['wall_s']:7.2f} {t['files']:5}")
    big = [t for t in times if t["files"] >= 50]
    if big:
        worst = max(big, key=lambda t: t["cpu_s"] / t["files"] * 50)
        print(f"  worst per 50 files: {worst['repo']} {worst['cpu_s'] / worst['files'] * 50:.2f} CPU s")
    print(f"files: {sum(t['files'] for t in times)}, total CPU {sum(t['cpu_s'] for t in times):.1f} s; "
          f"load {os.getloadavg()}")
    result["unjudged"], result["missed"] = report["unjudged"], report["missed"]
    if report["unjudged"]:
        print(f"\n{len(report['unjudged'])} findings not judged yet:")
        for u in report["unjudged"]:
            print(f"  {u['repo']} {u['path']}:{u['line']} {u['code']} {u['message']}")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        print(f"wrote {out}")
    return 0


def timing(corpus: Path, rounds: int, out: Path) -> int:
    """``mixprec lint <repo>`` as a user runs it (a fresh interpreter, imports included), for
    the corpus's repositories of 40 to 60 files and for the 50 largest files of the largest
    repository; median wall and CPU seconds over ``rounds`` interleaved rounds."""
    import resource
    import shutil
    import statistics
    import tempfile

    targets = []
    for entry in _entries():
        root = corpus / _local(entry["repo"])
        files = sorted(root.rglob("*.py"))
        if 40 <= len(files) <= 60:
            targets.append((entry["repo"], root, len(files)))
    biggest = max(_entries(), key=lambda e: sum(p.stat().st_size for p in (corpus / _local(e["repo"])).rglob("*.py")))
    root = corpus / _local(biggest["repo"])
    largest = sorted(root.rglob("*.py"), key=lambda p: -p.stat().st_size)[:50]
    scratch = Path(tempfile.mkdtemp(prefix="lint_timing_"))
    for path in largest:  # the same files, the same layout (imports still resolve between them)
        target = scratch / path.relative_to(root)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, target)
    targets.append((f"{biggest['repo']} (50 largest files)", scratch, 50))
    env = {**os.environ, "PYTHONPATH": str(HERE.parent / "src")}
    code = "import sys; from mixprec.cli import main; sys.exit(main(['lint', '--format', 'concise', sys.argv[1]]))"
    samples: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for _ in range(rounds):
        for name, path, _n in targets:
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            start = time.perf_counter()
            subprocess.run([sys.executable, "-c", code, str(path)], env=env, capture_output=True, check=False)
            wall = time.perf_counter() - start
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            samples[name].append((wall, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime))
    shutil.rmtree(scratch, ignore_errors=True)
    rows = []
    print(f"{'repository':60} {'files':>5} {'wall s':>7} {'CPU s':>7}   (median of {rounds}; load {os.getloadavg()})")
    for name, path, n in targets:
        wall = statistics.median(w for w, _ in samples[name])
        cpu = statistics.median(c for _, c in samples[name])
        rows.append({"repo": name, "files": n, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2)})
        print(f"{name:60} {n:5} {wall:7.2f} {cpu:7.2f}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rounds": rounds, "load": os.getloadavg(), "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


def findings(corpus: Path, repo: str) -> int:
    for entry in _entries(repo=repo):
        root, result, wall, cpu = lint_repo(corpus, entry)
        for f in result.findings:
            print(f"{f.path}:{f.line}:{f.col}: {f.code} {f.message}")
        print(f"{result.files} files, {cpu:.2f} CPU s")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("extract")
    p.add_argument("--mirror", type=Path, required=True)
    p.add_argument("--corpus", type=Path, required=True)
    p = sub.add_parser("measure")
    p.add_argument("--corpus", type=Path, required=True)
    p.add_argument("--split", default="all", choices=["all", "tune", "heldout"])
    p.add_argument("--json", type=Path, default=RESULTS)
    p = sub.add_parser("timing")
    p.add_argument("--corpus", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path, default=HERE / "results" / "lint_timing.json")
    p = sub.add_parser("findings")
    p.add_argument("--corpus", type=Path, required=True)
    p.add_argument("--repo", required=True)
    args = parser.parse_args(argv)
    if args.command == "extract":
        extract(args.mirror, args.corpus)
        return 0
    if args.command == "measure":
        return measure(args.corpus, args.split, args.json)
    if args.command == "timing":
        return timing(args.corpus, args.rounds, args.json)
    return findings(args.corpus, args.repo)


if __name__ == "__main__":
    sys.exit(main())
