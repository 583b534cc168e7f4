"""Files a user's work depends on, written aside and then published: a crash, a kill, a full disk or
a Ctrl-C mid-write leaves the previous file whole (or none), never a torn one that a later load trips
over. The core's writers (the autotune cache), the integrations' state file and the distributed
checkpoint's marker and pointer share this. (``mixprec.report.publish`` publishes a report's files as a
set, and ``lint --fix`` rewrites a user's script: each keeps its own copy of these steps, because those
rooms import nothing of the core.)"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make the renames in ``path`` durable (a no-op where directories cannot be opened)."""
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


def write_aside(path: str | os.PathLike[str], write: Callable[[IO[bytes]], Any], *, tmp_name: str | None = None) -> None:
    """Call ``write`` on a binary file beside ``path`` (``tmp_name``, default ``.<name>.tmp-<id>``), flush it
    to disk, rename it over ``path`` and make the rename durable; on any failure the temporary file is
    removed and ``path`` is as it was."""
    target = Path(path)
    tmp = target.with_name(tmp_name or f".{target.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "xb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(target.parent)
