"""The collectives of a compiled XLA program (``compiled.as_text()``): their dtypes and source lines.

Under ``jax.jit`` over sharded inputs the all-reduces are inserted by XLA's partitioner, so they exist
only in the compiled HLO. Each line of an op carries its location either as ``source_file=...
source_line=...`` or as a ``stack_frame_id`` into the module's ``FileNames`` / ``FunctionNames`` /
``FileLocations`` / ``StackFrames`` tables; both are read.
"""

from __future__ import annotations

import os
import re

_OP = re.compile(r"=\s*(\(?[^=]*?\)?)\s+(all-reduce|all-reduce-start|reduce-scatter)\(")
_DTYPE = re.compile(r"\b([a-z]+\d+)\[")
_TABLE_ENTRY = re.compile(r"^(\d+)\s+(.*)$")
_FIELDS = re.compile(r"(\w+)=(\d+)")
_SHORT = {"bf16": "bf16", "f16": "f16", "f32": "f32", "f64": "f64"}


def _package_dirs() -> tuple[str, ...]:
    import jax

    return (os.path.dirname(jax.__file__) + os.sep,)


_JAX_DIRS = _package_dirs()


def _tables(text: str) -> dict[str, dict[int, str]]:
    tables: dict[str, dict[int, str]] = {}
    current = None
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(line, {})
            continue
        if current is not None:
            m = _TABLE_ENTRY.match(line.strip())
            if m and line.strip():
                current[int(m.group(1))] = m.group(2)
            elif not line.strip() or line.startswith(("%", "ENTRY", "HloModule")):
                current = None
    return tables


def _frame(tables: dict[str, dict[int, str]], frame_id: int) -> str:
    files, funcs = tables.get("FileNames", {}), tables.get("FunctionNames", {})
    locs, frames = tables.get("FileLocations", {}), tables.get("StackFrames", {})
    chain: list[tuple[str, str, str]] = []
    seen = set()
    while frame_id in frames and frame_id not in seen:
        seen.add(frame_id)
        f = dict((k, int(v)) for k, v in _FIELDS.findall(frames[frame_id]))
        loc = dict((k, int(v)) for k, v in _FIELDS.findall(locs.get(f.get("file_location_id", -1), "")))
        name = files.get(loc.get("file_name_id", -1), '"?"').strip('"')
        chain.append((name, str(loc.get("line", "?")), funcs.get(loc.get("function_name_id", -1), '"?"').strip('"')))
        frame_id = f.get("parent_frame_id", 0)
        if frame_id == 0:
            break
    user = [c for c in chain if not c[0].startswith(_JAX_DIRS)]
    if not user:
        return "unknown"
    cwd = os.getcwd() + os.sep
    name, line, fn = user[0]
    return f"{name[len(cwd):] if name.startswith(cwd) else name}:{line} ({fn})"


def hlo_collectives(text: str) -> list[tuple[str, str, str]]:
    """``(dtype, op, where)`` for every all-reduce and reduce-scatter in a compiled module's text."""
    tables = _tables(text)
    found = []
    for line in text.splitlines():
        m = _OP.search(line)
        if not m:
            continue
        dtypes = sorted({d for d in _DTYPE.findall(m.group(1))})
        where = "unknown"
        sf = re.search(r"stack_frame_id=(\d+)", line)
        if sf:
            where = _frame(tables, int(sf.group(1)))
        else:
            src = re.search(r'source_file="([^"]+)"\s+source_line=(\d+)', line)
            if src:
                where = f"{src.group(1)}:{src.group(2)}"
        for d in dtypes:
            if d[0] in "bf" and d != "pred":  # floating (bf16, f16, f32, f64, f8...): the integer ones count flags
                found.append((_SHORT.get(d, d), m.group(2), where))
    return found
