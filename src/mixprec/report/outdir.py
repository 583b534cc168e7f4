"""Checks on a report directory, made before the work that fills it so a bad path fails fast."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def check_writable_dir(out: str | Path) -> Path:
    """Raise unless ``out`` is a directory, or can be created as one, that this process can write into."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"--out {str(path)!r} is a file; give a directory (it is created if missing)")
    base = path
    while not base.exists():  # the nearest existing directory: where the report's directory gets created
        base = base.parent
    if not base.is_dir():
        raise FileExistsError(f"--out {str(path)!r} cannot be created: {str(base)!r} is a file; give a directory")
    if not os.access(base, os.W_OK):
        raise PermissionError(f"--out {str(path)!r} cannot be written: no write permission in {str(base)!r}")
    # Permissions do not tell everything (root passes os.access everywhere; /proc and read-only
    # mounts refuse anyway): try. A probe file, or a directory made and removed, in what exists.
    try:
        if base == path:
            fd, probe = tempfile.mkstemp(prefix=".mixprec-probe-", dir=base)
            os.close(fd)
            os.unlink(probe)
        else:
            os.rmdir(tempfile.mkdtemp(prefix=".mixprec-probe-", dir=base))
    except OSError as e:
        raise PermissionError(f"--out {str(path)!r} cannot be written ({e.strerror or e}); give another directory") from None
    return path
