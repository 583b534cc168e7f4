"""docs/jax.md's Python blocks, the README's JAX block (fenced ```py so that the torch-only README test
leaves it alone) and mixprec.jax's docstring examples run."""

import doctest
import importlib
import pkgutil
import re
from pathlib import Path

import pytest

pytest.importorskip("jax.numpy")  # a submodule, not "jax": see conftest
pytest.importorskip("optax")

ROOT = Path(__file__).resolve().parents[2]


def _blocks(path: Path, fence: str, marked: bool = False) -> list[str]:
    """The ``fence`` blocks of ``path``; those after a ``<!-- docs-test: two-devices -->`` line (run by
    test_jax_goal.py on two host devices, in the slow job) only when ``marked``."""
    text = path.read_text(encoding="utf-8")
    found = re.findall(rf"(<!-- docs-test: two-devices -->\n)?```{fence}\n(.*?)```", text, flags=re.S)
    return [block for mark, block in found if bool(mark) == marked]


def test_docs_jax_md_python_blocks_run(tmp_path, monkeypatch):
    blocks = _blocks(ROOT / "docs" / "jax.md", "python")
    assert len(blocks) >= 6
    monkeypatch.chdir(tmp_path)
    import importlib.util

    have_flax = importlib.util.find_spec("flax") is not None
    for i, block in enumerate(blocks):  # each block is self-contained; fresh globals each
        if "flax" in block and not have_flax:
            continue  # the Flax examples need flax (in the jax extra)
        exec(compile(block, f"docs/jax.md block {i}", "exec"), {"__name__": "__docs__"})


def test_readme_jax_block_runs():
    blocks = _blocks(ROOT / "README.md", "py")
    assert len(blocks) == 1 and "mixprec import jax" in blocks[0]
    exec(compile(blocks[0], "README.md jax block", "exec"), {"__name__": "__readme__"})


def _modules():
    import mixprec.jax

    return ["mixprec.jax"] + [m.name for m in pkgutil.iter_modules(mixprec.jax.__path__, "mixprec.jax.")]


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples_run(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
