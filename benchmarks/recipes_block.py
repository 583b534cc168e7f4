"""The reference transformer block under every recipe: step time, speedup over fp32, FLOP/s against
the measured matmul peak, activation memory, host syncs per step (CUDA).

    python benchmarks/recipes_block.py                      # CPU shape on CPU, the seeds' shape on CUDA
    python benchmarks/recipes_block.py --threads 1 --reps 10 --json recipes.json --markdown
    python benchmarks/recipes_block.py --device cuda --compile both

Any 'mixprec bench' option passes through (see 'mixprec bench --help').
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))

from mixprec.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
