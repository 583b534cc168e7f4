"""DCP's file-system writer, with the size and CRC-32 of each file computed as it is written.

The completion marker lists every file of a checkpoint with its size and CRC-32. Reading the
files back after the save to compute them costs a second pass over the bytes; this writer
computes them on the bytes on their way to the file instead (DCP writes each file front to
back). A file whose stream was seeked, or whose size on disk is not the count of bytes written,
is read back instead (``digests`` says which were measured in flight).
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter

from mixprec.distributed import checkpoint_layout as layout


class _Counting:
    """A file opened for writing, seen through: every byte written goes into a running CRC-32."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.crc: int | None = 0
        self.size = 0

    def write(self, data: Any) -> int:
        n = self._stream.write(data)
        if self.crc is not None:
            view = memoryview(data).cast("B")
            self.crc = zlib.crc32(view[:n] if n is not None else view, self.crc)
            self.size += len(view) if n is None else n
        return n

    def seek(self, *args: Any) -> int:
        self.crc = None  # written out of order: read back after the save
        return self._stream.seek(*args)

    def __getattr__(self, name: str) -> Any:  # tell, fileno, flush, close, ...
        return getattr(self._stream, name)


class _CountingFileSystem(FileSystem):
    def __init__(self) -> None:
        super().__init__()
        self.written: dict[str, _Counting] = {}

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            counting = _Counting(stream)
            yield counting
        # DCP writes .metadata as .metadata.tmp, then renames it
        self.written[Path(path).name.removesuffix(".tmp")] = counting


def writer(path: Path) -> FileSystemWriter:
    """A ``FileSystemWriter`` for ``path`` that counts what it writes (see ``digests``)."""
    w = FileSystemWriter(str(path))
    w.fs = _CountingFileSystem()
    return w


def digests(w: FileSystemWriter, directory: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """name -> {"bytes", "crc32"} for ``names`` in ``directory``: from what ``w`` counted while
    writing when it saw the whole file, else read back."""
    counted = getattr(w.fs, "written", {})
    out, again = {}, []
    for name in names:
        c = counted.get(name)
        if c is not None and c.crc is not None and (directory / name).stat().st_size == c.size:
            out[name] = {"bytes": c.size, "crc32": f"{c.crc:08x}"}
        else:
            again.append(name)
    out.update(layout.digest_files(directory, again))
    return out
