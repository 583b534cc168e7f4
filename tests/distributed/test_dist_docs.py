"""docs/distributed.md says what the code does: the recipe table, the refusals, the wire arithmetic."""

import re
from pathlib import Path

from mixprec.distributed.fsdp import unsupported
from mixprec.recipes import get_recipe, list_recipes

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "distributed.md").read_text()


def test_the_recipes_the_doc_says_fsdp_refuses_are_exactly_the_refused_ones():
    row = next(line for line in DOC.splitlines() if line.startswith("| `bf16-true-kahan`"))
    said = set(re.findall(r"`([\w-]+)`", row.split("|")[1]))
    said = {n if n.startswith(("bf16", "fp16")) else f"bf16-true{n}" for n in said}
    refused = {r.name for r in list_recipes() if unsupported(r)}
    assert said == refused


def test_every_recipe_the_doc_says_fsdp_runs_is_accepted():
    for name in ("fp32", "bf16-mixed", "fp16-mixed", "bf16-true", "fp16-true"):
        assert unsupported(get_recipe(name)) is None, name


def test_the_wire_arithmetic():
    p, n = 7e9, 8
    fp32, bf16 = p * 8 * (n - 1) / n / 1e9, p * 4 * (n - 1) / n / 1e9  # DDP: 2 (N-1)/N of 4 or 2 bytes
    assert f"= {fp32:g} GB per step per rank in fp32 and {bf16:g} GB" in " ".join(DOC.split())


def test_the_files_the_doc_names_exist():
    for path in re.findall(r"`((?:examples|benchmarks|tests)/[\w/.-]+\.py)", DOC):
        assert (ROOT / path).exists() or (ROOT / "tests" / "distributed" / Path(path).name).exists(), path
