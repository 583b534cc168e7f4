"""Packaging: jax is an optional extra. Nothing outside mixprec/jax imports jax (one lazy import in the
compare CLI, for --backend jax), and without jax installed mixprec, its CLI and `mixprec --help` work and
--backend jax says what to install. These tests need no jax: they block it in a subprocess."""

import ast
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

from mixprec_test_env import src_env

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "mixprec"


def _jax_imports(tree: ast.AST) -> list[tuple[int, bool]]:
    """(line, at module level) of every import of jax, jaxlib, optax or mixprec.jax."""
    found = []
    top = {id(n) for n in getattr(tree, "body", [])}

    def names(node):
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        if isinstance(node, ast.ImportFrom) and node.module:
            return [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        return []

    for node in ast.walk(tree):
        for n in names(node):
            if n.split(".")[0] in ("jax", "jaxlib", "optax") or n.startswith("mixprec.jax"):
                found.append((node.lineno, id(node) in top))
                break
    return found


def test_nothing_outside_mixprec_jax_imports_jax_but_one_lazy_import():
    hits = {}
    for path in SRC.rglob("*.py"):
        if (SRC / "jax") in path.parents:
            continue
        found = _jax_imports(ast.parse(path.read_text(encoding="utf-8")))
        if found:
            hits[str(path.relative_to(SRC))] = found
    assert set(hits) == {"comparison/cli.py"}, hits
    assert all(not top_level for _, top_level in hits["comparison/cli.py"]) and len(hits["comparison/cli.py"]) == 1


BLOCK = """
import sys
class _NoJax:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("jax", "jaxlib", "optax"):
            raise ImportError(f"No module named {name!r} (blocked: a torch-only install)")
sys.meta_path.insert(0, _NoJax())
"""


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK + code], capture_output=True, text=True, env=src_env(), timeout=300)


def test_torch_only_install_imports_everything_and_runs_the_cli():
    proc = _run(
        "import importlib, pkgutil, io, contextlib, mixprec, mixprec.cli\n"
        "for info in pkgutil.walk_packages(mixprec.__path__, 'mixprec.'):\n"
        "    if not info.name.startswith('mixprec.jax') and info.name != 'mixprec.__main__':\n"
        "        try:\n"
        "            importlib.import_module(info.name)\n"
        "        except ImportError as e:\n"
        "            # an integration whose framework is not installed says which extra to install\n"
        "            if 'pip install \"mixprec[' not in str(e):\n"
        "                raise\n"
        "for argv in (['--help'], ['compare', '--help']):\n"
        "    try:\n"
        "        with contextlib.redirect_stdout(io.StringIO()):\n"
        "            mixprec.cli.main(argv)\n"
        "    except SystemExit as e:\n"
        "        assert e.code == 0, argv\n"
        "print('rc', mixprec.cli.main(['compare', '--backend', 'jax']))\n"
        "try:\n"
        "    import mixprec.jax\n"
        "except ImportError as e:\n"
        "    print('import:', e)\n"
        "print('JAX' if any(m.split('.')[0] in ('jax', 'optax') for m in sys.modules) else 'NO-JAX')\n"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out, err = proc.stdout, " ".join(proc.stderr.split())
    assert "rc 2" in out and "pip install 'mixprec[jax]'" in err
    assert "import: mixprec.jax needs jax" in out and out.strip().endswith("NO-JAX")


def test_help_does_not_import_jax_even_when_installed():
    code = (
        "import sys, io, contextlib, mixprec.cli\n"
        "try:\n"
        "    with contextlib.redirect_stdout(io.StringIO()):\n"
        "        mixprec.cli.main(['compare', '--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('JAX' if 'jax' in sys.modules else 'NO-JAX')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=src_env(), check=True).stdout
    assert out.strip() == "NO-JAX"


def test_pyproject_has_the_jax_extra():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {r.split(">")[0].split("=")[0].split("<")[0].strip() for r in extras["jax"]}
    assert names == {"jax", "jaxlib", "optax", "flax"}
