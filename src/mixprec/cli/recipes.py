"""``mixprec recipes``: list the recipes and say what ``auto`` picks on this machine, and why."""

from __future__ import annotations

import argparse

HELP = "list the recipes and show what 'auto' picks on this machine"
DESCRIPTION = """\
List every recipe name mixprec accepts, what each keeps in fp32 and whether it scales the loss,
and what 'auto' chooses for a device, with the reason.

examples:
  mixprec recipes
  mixprec recipes --device cuda
  mixprec recipes --json
"""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="device to resolve 'auto' for (default: cuda if available, else cpu)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    import json
    import sys

    from mixprec.recipes import list_recipes, recipe_aliases, resolve_recipe

    try:
        auto = resolve_recipe("auto", args.device)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = []
    for r in list_recipes():
        aliases = list(recipe_aliases(r))
        rows.append(
            {
                "name": r.name,
                "aliases": aliases,
                "policy": str(r.policy),
                "loss_scaling": r.loss_scaling,
                "fp32_modules": list(r.fp32_modules),
                "description": r.description,
            }
        )
    if args.json:
        print(json.dumps({"recipes": rows, "auto": {"recipe": auto.name, "attention": auto.attention,
                                                     "reason": auto.reason}}, indent=2))
        return 0
    from rich.table import Table

    from mixprec.report.terminal import make_console

    table = Table(title="mixprec recipes")
    for col in ("name", "aliases", "policy", "loss scaling", "fp32 islands"):
        table.add_column(col, no_wrap=col in ("name", "policy"))
    for row in rows:
        table.add_row(
            row["name"], ", ".join(row["aliases"]), row["policy"], row["loss_scaling"],
            ", ".join(row["fp32_modules"]) or "-",
        )
    console = make_console()
    console.print(table)
    for row in rows:
        console.print(f"  [bold]{row['name']}[/bold]: {row['description']}")
    console.print("Any jmp policy string also works, e.g. 'p=f32,c=bf16,o=f32'.")
    attention = "" if auto.attention == "recipe" else f" (attention: {auto.attention})"
    console.print(f"[bold]auto[/bold] -> {auto.name}{attention}: {auto.reason.removeprefix('auto: ')}")
    return 0
