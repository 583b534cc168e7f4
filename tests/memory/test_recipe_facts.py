"""``mixprec memory --params`` plans the built-in recipes from a shipped table, without torch.

The table (``mixprec.memory.recipe_facts``) is generated from the recipes; these tests hold it to
what the generator writes, and the plans it gives to the ones the recipes give through torch."""

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from mixprec.cli import main
from mixprec.memory import cli as memory_cli
from mixprec_test_env import src_env

ROOT = Path(__file__).resolve().parents[2]


def test_the_shipped_table_is_what_the_generator_writes_from_the_recipes():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_recipe_facts.py"), "--check"],
                          capture_output=True, text=True, env=src_env(), timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _json(argv: list[str]) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["memory", *argv, "--json"]) == 0
    return json.loads(out.getvalue())


ARGS = [
    ["--params", "7B", "--recipe", "all"],
    ["--params", "1.3B", "--trainable", "1B", "--recipe", "bf16-true,O2,16-mixed", "--optimizer", "sgd-momentum"],
    ["--params", "7B", "--recipe", "bf16-true,fp8", "--world-size", "8", "--parallel", "fsdp"],
    ["--params", "7B", "--recipe", "all", "--world-size", "8", "--parallel", "fsdp"],  # (FSDP2's refusals left out)
    ["--params", "125M", "--recipe", "fp16-true", "--accumulate", "4", "--batch", "8", "--seq", "512",
     "--d-model", "768", "--layers", "12", "--heads", "12", "--device", "cuda"],
]


@pytest.mark.parametrize("argv", ARGS, ids=lambda a: " ".join(a[:4]))
def test_the_table_plans_exactly_what_the_recipes_plan(argv, monkeypatch):
    fast = _json(argv)
    monkeypatch.setattr(memory_cli, "_builtin_facts", lambda args: None)  # the path through torch
    assert _json(argv) == fast


def test_names_the_table_does_not_know_take_the_full_path_and_its_errors(capsys):
    assert main(["memory", "--params", "7B", "--recipe", "bf16-mixd"]) == 2
    assert "bf16-mixed" in capsys.readouterr().err  # the did-you-mean of the recipe registry
    plans = _json(["--params", "7B", "--recipe", "auto"])["plans"]  # resolved by the machine, through torch
    assert len(plans) == 1 and plans[0]["recipe"] != "auto"
    # a jmp policy string is one recipe, its commas its own (it was split into three unknown names)
    plans = _json(["--params", "7B", "--recipe", "bf16-mixed,p=f32,c=bf16,o=f32,p=bf16,c=bf16,o=f32"])["plans"]
    assert len(plans) == 3 and plans[0]["recipe"] == "bf16-mixed"
    assert plans[1]["bytes"]["weights"] == 7e9 * 4 and plans[2]["bytes"]["weights"] == 7e9 * 2


BLOCK_TORCH = """
import sys
class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == 'torch' or name.startswith('torch.'):
            raise ImportError('torch is blocked in this test')
sys.meta_path.insert(0, _NoTorch())
"""


def test_a_bare_count_never_imports_torch():
    code = BLOCK_TORCH + (
        "import time; t = time.perf_counter()\n"
        "from mixprec.cli import main\n"
        "rc = main(['memory', '--params', '7B', '--recipe', 'bf16-mixed,bf16-true,bf16-true-sr'])\n"
        "print('rc', rc, 'torch' in sys.modules, round(time.perf_counter() - t, 2))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=src_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    last = proc.stdout.strip().splitlines()[-1].split()
    assert last[:3] == ["rc", "0", "False"], proc.stdout[-2000:]
    assert "112.07 GB" in proc.stdout  # bf16-true's 7B AdamW peak (docs/masters.md: 112.1 GB)
