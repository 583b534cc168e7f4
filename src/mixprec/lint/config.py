"""``[tool.mixprec.lint]`` in pyproject.toml.

    [tool.mixprec.lint]
    select = ["MP1"]          # codes or prefixes; default: every rule
    ignore = ["MP201"]
    exclude = ["legacy/*"]     # globs, matched against paths found by walking directories

The file is the one given with --config, else the nearest pyproject.toml from the current
directory upwards.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

_KEYS = ("select", "ignore", "exclude")


class ConfigError(ValueError):
    """A config file that exists but says something the linter cannot use."""


@dataclass(frozen=True)
class LintConfig:
    select: list[str] | None = None
    ignore: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)
    path: Path | None = None


def _toml_loads():
    try:
        import tomllib  # Python 3.11+

        return tomllib.loads
    except ModuleNotFoundError:
        try:
            import tomli  # the same parser, for 3.10

            return tomli.loads
        except ModuleNotFoundError:
            return None


def find_pyproject(start: Path) -> Path | None:
    for directory in (start, *start.parents):
        candidate = directory / "pyproject.toml"
        if candidate.is_file():
            return candidate
    return None


def load_config(explicit: str | None = None, start: Path | None = None) -> LintConfig:
    """Read the config; an absent file or table gives the defaults."""
    if explicit is not None:
        path = Path(explicit)
        if not path.is_file():
            raise ConfigError(f"Config file {explicit!r} does not exist.")
    else:
        path = find_pyproject(start or Path.cwd())
        if path is None:
            return LintConfig()
    loads = _toml_loads()
    if loads is None:
        print(
            f"mixprec lint: not reading {path}: Python {sys.version_info.major}.{sys.version_info.minor} "
            "has no TOML parser (install tomli to use [tool.mixprec.lint]).",
            file=sys.stderr,
        )
        return LintConfig()
    try:
        data = loads(path.read_text(encoding="utf-8"))
    except Exception as error:  # tomllib.TOMLDecodeError, or the tomli one
        raise ConfigError(f"Cannot parse {path}: {error}") from error
    table = data.get("tool", {}).get("mixprec", {}).get("lint", {})
    unknown = sorted(set(table) - set(_KEYS))
    if unknown:
        raise ConfigError(
            f"Unknown key {unknown[0]!r} in [tool.mixprec.lint] of {path}; expected one of {', '.join(_KEYS)}."
        )
    for key, value in table.items():
        if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise ConfigError(
                f"[tool.mixprec.lint] {key} in {path} must be a list of strings, got {value!r}."
            )
    return LintConfig(table.get("select"), table.get("ignore", []), table.get("exclude", []), path)
