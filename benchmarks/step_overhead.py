"""MixedPrecision.step against the same loop written by hand with torch.autocast + torch.amp.GradScaler.

Same model (the reference block), recipe, AdamW, clipping and batches; the arms are interleaved in
one run and the per-round ratio mixprec / hand is printed with its spread, next to the exact list of
aten ops mixprec adds per step. Issue 2's goal: <= 1.02x on CPU.

    python benchmarks/step_overhead.py                                  # fp32 and fp16-mixed, CPU, shape small
    python benchmarks/step_overhead.py --reps 100 --threads 1 --json overhead.json
    python benchmarks/step_overhead.py --device cuda --shape ref --recipes bf16-mixed fp16-mixed --optimizer fused foreach

Any other 'mixprec bench' option passes through (see 'mixprec bench --help').
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))

from mixprec.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", "--overhead", *sys.argv[1:]]))
