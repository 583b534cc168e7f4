"""Tables fit the terminal: columns fold into several tables instead of cells wrapping or names
being cut, at 80 and 100 columns (bench's recipe table, memory's recipe columns)."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest
from mixprec_test_env import src_env
from rich.console import Console

from mixprec.bench import tables
from mixprec.recipes import list_recipes
from mixprec.report.terminal import column_groups, fitted_tables

RECIPES = [r.name for r in list_recipes()]


def _render(tables_, width: int) -> str:
    console = Console(width=width, file=io.StringIO(), record=True, color_system=None)
    for t in tables_:
        console.print(t)
    return console.export_text()


def _assert_fits(text: str, width: int, names: list[str]) -> None:
    lines = text.splitlines()
    assert all(len(line) <= width for line in lines), max(lines, key=len)
    assert "…" not in text
    for name in names:  # every row label whole, on one line
        assert any(f" {name} " in line for line in lines), name


def test_column_groups_keep_the_label_columns_and_every_other_column_once():
    headers = ["name"] + [f"column {i}" for i in range(12)]
    rows = [["x" * 10] + ["y" * 12] * 12]
    groups = column_groups(headers, rows, 80)
    assert len(groups) > 1 and all(g[0] == 0 for g in groups)
    assert sorted(i for g in groups for i in g[1:]) == list(range(1, 13))
    assert column_groups(headers, rows, 10_000) == [list(range(13))]


def test_a_column_wider_than_the_terminal_gets_a_table_of_its_own():
    groups = column_groups(["a", "b", "c"], [["1", "x" * 200, "2"]], 80)
    assert [1] in [g[1:] for g in groups]


def _fake_bench_doc() -> dict:
    results = []
    for i, name in enumerate(RECIPES):
        results.append({
            "label": name, "status": "ok", "step_s": {"median": 0.0123 + i / 1000, "q25": 0.012, "q75": 0.0131},
            "speedup_vs_fp32": {"median": 1.234, "q25": 1.1, "q75": 1.456}, "tokens_per_s": 12345.0,
            "achieved_flops_per_s": 4.2e10, "peak_fraction": 0.0123, "peak_key": "bf16", "ideal_s": 0.000444,
            "memory": {"saved_bytes": 12 * 2**20, "forward_delta": 14 * 2**20, "peak_step": 123 * 2**20},
            "syncs_per_step": None,
        })
    results.append({"label": "bf16-mixed+compile", "status": "error", "error": "RuntimeError: " + "x" * 300})
    return {"results": results}


@pytest.mark.parametrize("width", [80, 100])
def test_bench_recipe_table_fits_the_terminal_with_every_recipe_name_whole(width):
    headers, rows = tables.bench_rows(_fake_bench_doc())
    text = _render(fitted_tables(headers, rows, width, title="reference block"), width)
    _assert_fits(text, width, RECIPES)
    for h in headers:  # every column is somewhere
        assert h in text


@pytest.mark.parametrize("width", [80, 100])
def test_memory_all_recipes_fits_the_terminal_with_every_recipe_header_whole(width):
    env = {**src_env(), "COLUMNS": str(width)}
    out = subprocess.run([sys.executable, "-m", "mixprec", "memory", "--params", "7B", "--recipe", "all"],
                         capture_output=True, text=True, env=env, check=True).stdout
    lines = out.splitlines()
    table_lines = [line for line in lines if line[:1] in "┏┃┡│└"]
    assert table_lines and all(len(line) <= width for line in table_lines), max(table_lines, key=len)
    assert "…" not in out
    headers = " ".join(line for line in lines if line.startswith("┃"))
    for name in RECIPES:
        assert f" {name} " in headers, name
