"""examples/train_distributed.py under torch's own launcher (torchrun), 2 CPU processes: it trains,
saves, and a second launch resumes from the checkpoint at the step it was saved."""

import re
import subprocess
import sys
from pathlib import Path

from mixprec_test_env import src_env

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_distributed.py"


def _torchrun(*args, timeout=150):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(EXAMPLE), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, env=src_env(), timeout=timeout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


def _losses(text):
    return {int(s): float(v) for s, v in re.findall(r"step\s+(\d+)\s+loss ([\d.]+)", text)}


def test_the_torchrun_example_trains_saves_and_resumes(tmp_path):
    first = _torchrun("--steps", "21", "--checkpoint", str(tmp_path / "ck"))
    assert "parallel fsdp, gradients reduce-scattered in f32, 2 ranks" in first
    losses = _losses(first)
    assert losses[20] < losses[0] - 0.3  # it learned (ln 96 = 4.56 at the start)
    second = _torchrun("--steps", "1", "--resume", str(tmp_path / "ck"), "--parallel", "fsdp",
                       "--checkpoint", str(tmp_path / "ck"), "--keep", "1")
    assert list(_losses(second)) == [21] and f"resumed from {tmp_path / 'ck' / 'step-000021'}" in second
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["latest", "step-000022"]  # keep 1
