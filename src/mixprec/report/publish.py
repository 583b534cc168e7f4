"""Publish a report's files as one set: every file written aside, then renamed into place, the one that
marks the set complete (the JSON) last.

A report written file by file in place (the probe's case: a Ctrl-C, a full disk, a write error at the
CSV) left the new run's PNG and JSON beside the old run's CSV and HTML, a mixed set that looked
complete. Here nothing in the directory changes until every file has been written in full and flushed
under a temporary name (``.<name>.tmp-<id>`` in the same directory, so the renames stay on one file
system); the old files are then moved aside, the new ones renamed in (the marker last) and the old ones
deleted. A failure at any point removes what was written and puts the old files back: the directory
holds the old set whole, or the new one.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove(paths: list[Path]) -> None:
    for p in paths:
        try:
            p.unlink()
        except OSError:
            pass


def publish_files(directory: Path, contents: dict[str, bytes | str], last: str, drop: tuple[str, ...] = ()) -> None:
    """Write ``contents`` (file name -> bytes or UTF-8 text) into ``directory`` as one set, ``last`` renamed
    into place after every other file; the files named in ``drop`` (an earlier report's that this one has
    none of) leave with the old set. Raises what failed; the directory then holds the old files as they were.
    compare, ``--explain``, doctor and bench publish through this."""
    tag = uuid.uuid4().hex[:8]
    order = [n for n in contents if n != last] + [last]
    drop = tuple(n for n in drop if n not in contents)
    fresh = {n: directory / f".{n}.tmp-{tag}" for n in order}
    aside = {n: directory / f".{n}.old-{tag}" for n in (*order, *drop)}
    for name in order:  # (a directory there is not an earlier report's file: it is not ours to replace)
        if (directory / name).is_dir():
            raise IsADirectoryError(f"{directory / name} is a directory, where the report writes a file: move it "
                                    "away or choose another --out")
    moved: list[str] = []  # old files moved aside
    placed: list[str] = []  # new files renamed in
    try:
        for name in order:
            data = contents[name]
            with open(fresh[name], "wb") as f:
                f.write(data.encode("utf-8") if isinstance(data, str) else data)
                f.flush()
                os.fsync(f.fileno())
        for name in (last, *drop, *reversed(order[:-1])):  # the marker first: no complete old set from here
            if (directory / name).is_file():
                os.replace(directory / name, aside[name])
                moved.append(name)
        for name in order:  # ... and the marker last: the new set is complete once it is there
            os.replace(fresh[name], directory / name)
            placed.append(name)
    except BaseException:  # Ctrl-C too: the old set goes back
        _remove([directory / n for n in placed] + list(fresh.values()))
        for name in moved:
            try:
                os.replace(aside[name], directory / name)
            except OSError:
                pass
        raise
    _remove([aside[n] for n in moved])
    _fsync_dir(directory)


def publish_file(path: Path, data: bytes | str) -> None:
    """One file written aside and renamed over ``path`` (``bench --json``): a full disk or a Ctrl-C mid-write
    leaves the old file, never a torn one."""
    publish_files(Path(path).parent, {Path(path).name: data}, Path(path).name)
