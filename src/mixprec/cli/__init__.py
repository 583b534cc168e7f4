"""The ``mixprec`` command.

Each subcommand lives in its own module with three names: ``HELP`` (one line), ``configure(parser)``
(adds its arguments) and ``run(args) -> int`` (the exit code). Those modules import torch only inside
``run``, so ``mixprec --help`` and ``mixprec lint`` start without loading torch.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings

# subcommand -> module. The order here is the order in --help.
SUBCOMMANDS: dict[str, str] = {
    "compare": "mixprec.comparison.cli",  # the main job: does 16-bit training track fp32?
    "doctor": "mixprec.diagnostics.cli",
    "recipes": "mixprec.cli.recipes",
    "memory": "mixprec.memory.cli",
    "lint": "mixprec.lint.cli",
    "bench": "mixprec.bench.cli",
    "infer-check": "mixprec.inference.cli",  # does bf16 / fp16 inference agree with fp32?
}


def build_parser() -> argparse.ArgumentParser:
    from mixprec import __version__

    parser = argparse.ArgumentParser(
        prog="mixprec",
        description=(
            "Mixed-precision training for PyTorch: choose a recipe, check on your own model "
            "that 16-bit training tracks fp32, and find where it breaks."
        ),
        epilog="Run 'mixprec COMMAND --help' for the options of one command.",
    )
    parser.add_argument("--version", action="version", version=f"mixprec {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(
            name,
            help=module.HELP,
            description=getattr(module, "DESCRIPTION", module.HELP),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.configure(p)
        p.set_defaults(_run=module.run)
    return parser


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
    print(f"warning: {message}", file=file or sys.stderr)


def main(argv: list[str] | None = None) -> int:
    # The console script, unlike 'python -m', does not put the working directory on sys.path;
    # '--task my_module:make_task' (compare, doctor, memory) should find my_module.py where the user stands.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    # a command's warnings are messages to its user: one line each, not Python's source excerpts
    shown, warnings.showwarning = warnings.showwarning, _show_warning
    try:
        return _main(argv)
    finally:
        warnings.showwarning = shown


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
