"""``mixprec lint PATH...``: the command-line face of the linter. Imports no torch."""

from __future__ import annotations

import argparse
import json
import os
import sys

from mixprec.lint.rules import RULES

INTERNAL_ERROR = 3  # the linter failed (on a file, or at all): not a finding (1), not usage (2)
HELP = "check training scripts for mixed-precision traps without running them"
DESCRIPTION = (
    "Read Python training scripts (files or directories) and report the mixed-precision\n"
    "traps in them: clipping before unscale_, backward() in autocast, a step that bypasses\n"
    "the GradScaler, a 16-bit model without fp32 master weights, deprecated torch.cuda.amp...\n\n"
    "Rules:\n"
    + "\n".join(
        f"  {r.code}  {r.name}{'  (fixable)' if r.fixable else ''}{'  (info)' if r.severity == 'info' else ''}"
        for r in RULES.values()
    )
    + "\n\nExit status: 0 nothing found (or only info notes), 1 problems found, 2 usage or config error,\n"
    "3 the linter itself failed on a file (reported as MP000 'lint could not analyse'; the others\n"
    "are still checked).\n"
    "Silence one line with '# noqa: MP101'; configure in [tool.mixprec.lint] of pyproject.toml."
)


def _codes(text: str) -> list[str]:
    return [c for c in text.split(",") if c.strip()]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="*", metavar="PATH", help="files or directories to check")
    parser.add_argument(
        "--select", type=_codes, metavar="CODES", help="only these codes or prefixes, comma separated (e.g. MP1,MP201)"
    )
    parser.add_argument(
        "--ignore", type=_codes, default=[], metavar="CODES", help="skip these codes or prefixes (added to the config's)"
    )
    parser.add_argument("--fix", action="store_true", help="rewrite files in place for the fixable rules")
    parser.add_argument(
        "--format",
        choices=("text", "concise", "json"),
        default="text",
        help="text: each finding with why and fix; concise: one line each; json: a list of objects",
    )
    parser.add_argument("--config", metavar="FILE", help="pyproject.toml to read (default: nearest one upwards)")
    parser.add_argument("--explain", metavar="CODE", help="print what a rule checks, why and how to fix it")


def _explain(code: str) -> int:
    rule = RULES.get(code.upper())
    if rule is None:
        print(f"mixprec lint: unknown rule {code!r}; expected one of {', '.join(RULES)}", file=sys.stderr)
        return 2
    print(f"{rule.code} {rule.name}{' (fixable with --fix)' if rule.fixable else ''}\n\nWhy: {rule.why}\nFix: {rule.fix}")
    return 0


def run(args: argparse.Namespace) -> int:
    from mixprec.lint.config import ConfigError, load_config
    from pathlib import Path

    from mixprec.lint.engine import iter_python_files, lint_paths
    from mixprec.lint.rules import UnknownCodeError, enabled_codes, expand_codes

    if args.explain:
        return _explain(args.explain)
    if not args.paths:
        print("mixprec lint: give at least one file or directory (mixprec lint --help)", file=sys.stderr)
        return 2
    try:
        config = load_config(args.config)
        origin = str(config.path) if config.path else "options"
        if args.select is not None:  # a typo here is the command line's, not the config file's
            codes = expand_codes(args.select, "--select") - expand_codes(config.ignore, origin)
        else:
            codes = enabled_codes(config.select, config.ignore, origin)
        codes -= expand_codes(args.ignore, "--ignore")
        result = lint_paths(args.paths, codes, fix=args.fix, exclude=config.exclude)
        # a named path that holds no Python file checked nothing: say so (a typo'd directory, /dev/null)
        empty = [p for p in args.paths if next(iter(iter_python_files([Path(p)], config.exclude)), None) is None]
    except (ConfigError, UnknownCodeError) as error:
        print(f"mixprec lint: {error}", file=sys.stderr)
        return 2
    except FileNotFoundError as error:
        print(f"mixprec lint: no such file or directory: {error}", file=sys.stderr)
        return 2
    except Exception as error:  # noqa: BLE001 - a crash of the linter must not read as findings (1)
        print(f"mixprec lint: internal error: {type(error).__name__}: {error}", file=sys.stderr)
        return INTERNAL_ERROR

    for p in empty:
        print(f"mixprec lint: {p}: no Python file to check there (nothing was checked)", file=sys.stderr)
    if empty and not result.files:
        return 2
    try:
        code = _report(args, result)
        sys.stdout.flush()  # a broken pipe shows here, inside the handler, not at interpreter exit
    except BrokenPipeError:  # the reader went away (``mixprec lint . | head``): stop quietly
        _silence_stdout()
        code = 1 if _problems(result) else 0
    if result.failed:
        n = len(result.failed)
        print(f"mixprec lint: could not analyse {n} file{'s' if n != 1 else ''} (see MP000 above)", file=sys.stderr)
        return INTERNAL_ERROR
    return 2 if empty and code == 0 else code


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no file descriptor (a captured stream): nothing to flush there
        pass


def _problems(result) -> list:
    """The findings that fail the run as problems (1): every one but the info notes and the
    files the linter failed on (those fail it with 3)."""
    return [f for f in result.findings if f.severity != "info" and not f.internal]


def _report(args: argparse.Namespace, result) -> int:
    if args.format == "json":
        print(json.dumps([f.as_dict() for f in result.findings], indent=2))
        return 1 if _problems(result) else 0
    for path, count in result.fixed.items():
        print(f"{path}: fixed {count} problem{'s' if count != 1 else ''}")
    for finding in result.findings:
        print(finding.as_text())
        if args.format == "text":
            rule = RULES[finding.code]
            print(f"    why: {rule.why}\n    fix: {rule.fix}")
    problems = _problems(result)
    notes = sum(f.severity == "info" for f in result.findings)
    noted = f", {notes} note{'s' if notes != 1 else ''} (info)" if notes else ""
    if result.failed:
        noted += f", {len(result.failed)} not analysed"
    n, files = len(problems), len({f.path for f in problems})
    if n:
        fixable = sum(f.fixable for f in result.findings)
        hint = f" ({fixable} fixable with --fix)" if fixable and not args.fix else ""
        checked = f" ({result.files} checked)" if result.files != files else ""
        print(f"{n} problem{'s' if n != 1 else ''} in {files} file{'s' if files != 1 else ''}{checked}{hint}{noted}")
        return 1
    print(f"no problems in {result.files} file{'s' if result.files != 1 else ''}{noted}")
    return 0
