"""What the CRC-32 manifest costs a checkpoint: save and load time with the checksums against sizes only.

``save_checkpoint`` records every file's size and CRC-32 in the completion marker (computed on the
bytes as DCP writes them); ``load_checkpoint`` reads every file once more to check both before DCP
reads it.
This times both paths on one process for a model of ``--params`` fp32 parameters with AdamW state
(a checkpoint of about 12 bytes per parameter), the two arms interleaved (A B, B A, ...) so that
load from other processes hits both alike. The "sizes only" arm saves without the CRC-32 and loads
with ``checksums=False`` (the file sizes are still checked). Prints a table and writes a JSON.

    python benchmarks/checkpoint_checksum.py                       # 16M parameters, 7 rounds
    python benchmarks/checkpoint_checksum.py --params 64e6 --rounds 5 --dir /mnt/fast
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import zlib
from pathlib import Path

import torch

import mixprec
from mixprec.distributed import checkpoint_io
from mixprec.instruments.machine import describe, environment

ROOT = Path(__file__).resolve().parents[1]


def _model(params: int) -> torch.nn.Module:
    width = 1024
    layers = max(1, round(params / (width * width + width)))
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def _sizes_only(storage, directory, names):
    return {n: {"bytes": (Path(directory) / n).stat().st_size, "crc32": "-"} for n in names}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=float, default=16e6, help="fp32 parameters of the model (default 16e6)")
    p.add_argument("--rounds", type=int, default=7, help="timed saves and loads per arm")
    p.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temporary directory)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "checkpoint_checksum_xeon.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    mp = mixprec.MixedPrecision("bf16-mixed", "cpu")
    model = mp.prepare(_model(int(args.params)))
    opt = torch.optim.AdamW(mp.parameters(model), lr=1e-3)
    x = torch.randn(4, 1024)
    with mp.autocast():
        loss = model(x).float().pow(2).mean()
    mp.step(loss, opt)  # AdamW's state exists

    real_digest = checkpoint_io.digests
    arms = {"crc32": (real_digest, True), "sizes only": (_sizes_only, False)}  # (digests at save, checksums at load)
    base = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir))
    times: dict[str, dict[str, list[float]]] = {a: {"save": [], "load": []} for a in arms}
    nbytes = 0
    try:
        for r in range(args.rounds + 1):  # round 0 warms up (page cache, imports)
            order = list(arms) if r % 2 else list(reversed(arms))
            for arm in order:
                checkpoint_io.digests, checksums = arms[arm]
                root = base / f"{arm.replace(' ', '-')}-{r}"
                t0 = time.perf_counter()
                where = mixprec.save_checkpoint(root, model=model, optimizer=opt, mp=mp)
                t1 = time.perf_counter()
                mixprec.load_checkpoint(root, model=model, optimizer=opt, mp=mp, checksums=checksums)
                t2 = time.perf_counter()
                nbytes = sum(f.stat().st_size for f in Path(where).iterdir())
                if r:
                    times[arm]["save"].append(t1 - t0)
                    times[arm]["load"].append(t2 - t1)
                shutil.rmtree(root)
        # CRC-32 alone, on a buffer of the checkpoint's size (from memory)
        buf = os.urandom(min(nbytes, 256 << 20))
        t0 = time.perf_counter()
        zlib.crc32(buf)
        crc_gbps = len(buf) / (time.perf_counter() - t0) / 1e9
    finally:
        checkpoint_io.digests = real_digest
        shutil.rmtree(base, ignore_errors=True)

    rows = {}
    for what in ("save", "load"):
        ratios = sorted(a / b for a, b in zip(times["crc32"][what], times["sizes only"][what]))
        rows[what] = {"crc32_s": statistics.median(times["crc32"][what]),
                      "sizes_only_s": statistics.median(times["sizes only"][what]),
                      "ratio_median": statistics.median(ratios), "ratio_min": ratios[0], "ratio_max": ratios[-1]}
    env = environment("cpu")
    load = os.getloadavg()
    print(f"checkpoint of {nbytes / 1e6:.0f} MB ({int(args.params):,} fp32 parameters + AdamW), {args.rounds} rounds; "
          f"{describe(env)}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"{'':6}{'with CRC-32':>14}{'sizes only':>14}{'ratio (median, min-max over rounds)':>40}")
    for what, row in rows.items():
        print(f"{what:6}{row['crc32_s']:13.3f}s{row['sizes_only_s']:13.3f}s"
              f"{row['ratio_median']:>18.3f}  [{row['ratio_min']:.3f}, {row['ratio_max']:.3f}]")
    print(f"CRC-32 alone: {crc_gbps:.2f} GB/s (one core, from memory)")
    result = {"bytes": nbytes, "params": int(args.params), "rounds": args.rounds, "rows": rows, "times": times,
              "crc32_gb_per_s": crc_gbps, "environment": env, "loadavg": load}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))
        print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
