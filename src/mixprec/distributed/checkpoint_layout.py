"""Where ``save_checkpoint`` puts its files, and how a save becomes visible all at once.

A checkpoint path is a directory of checkpoints::

    ckpt/
      latest                 the name of the newest complete checkpoint ("step-000030"), replaced atomically
      step-000010/           one torch.distributed.checkpoint directory (.metadata, __0_0.distcp, ...)
        mixprec-checkpoint.json   the completion marker: step, world size, recipe, versions, and
                                  every file of the checkpoint with its size and CRC-32
      step-000030/
      .tmp-<id>/             a save in progress, or one that was killed: never loaded; the next
                             save removes it
      .trash-<id>/           a checkpoint being deleted (replaced, or beyond keep=): never loaded

A save writes into a fresh ``.tmp-<id>`` beside the published checkpoints, writes the marker
last, then renames the directory to ``step-<N>`` and points ``latest`` at it (each a rename, which
POSIX file systems do atomically). Saving a step that is already there (a run started again from
scratch onto the same path) points ``latest`` at the new directory first, then moves the old one
away, then renames the new one into its place. At every instant ``latest`` names a complete
checkpoint: the previous one until the new one is complete, then the new one.

Everything here runs on one rank (rank 0 for what changes the directory), with no collective;
``checkpoint.py`` says which rank calls what.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from mixprec._files import fsync_dir, write_aside

MARKER = "mixprec-checkpoint.json"
POINTER = "latest"
LAYOUT = 1  # the version of this layout and of the marker's fields
TMP, TRASH = ".tmp-", ".trash-"
_STEP = re.compile(r"step-\d+$")
_CHUNK = 8 << 20


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved here, or loaded into this model/optimizer/MixedPrecision;
    the message says what was found and what to do. (An ``Exception``: torch's own
    ``CheckpointException`` is a ``BaseException``, which ``except Exception`` does not catch.)"""


def _fault_point(name: str) -> None:
    """Called at each step of a save that a crash could interrupt (a no-op; the fault tests
    replace it with a function that kills the process at the point they name)."""


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def _ours(name: str) -> bool:
    return (name == POINTER or bool(_STEP.match(name)) or name.startswith((TMP, TRASH))
            or name.startswith(POINTER + TMP))


def _is_dcp_dir(entries: Iterable[str]) -> bool:
    return any(n == ".metadata" or n.endswith(".distcp") for n in entries)


def _write_atomically(path: Path, text: str) -> None:
    write_aside(path, lambda f: f.write(text.encode()), tmp_name=f"{path.name}{TMP}{uuid.uuid4().hex[:8]}")


# ---------------------------------------------------------------------------- saving (rank 0)


def begin(root: Path) -> str:
    """Check that ``root`` can hold checkpoints, remove what killed saves left, create a fresh
    temporary directory; returns its id. Raises ``CheckpointError`` before anything is written."""
    if root.exists() and not root.is_dir():
        raise CheckpointError(f"{root} is a file: save_checkpoint(path) writes a directory of checkpoints at path "
                              "(path/step-N/, path/latest). Choose another path, or move the file away")
    if root.is_dir():
        entries = sorted(os.listdir(root))
        if _is_dcp_dir(entries):
            raise CheckpointError(
                f"{root} holds a torch.distributed.checkpoint directory written in place (no 'latest', no "
                f"{MARKER}): the layout of an earlier mixprec, or another tool's. Saving into it could mix two saves. "
                "Save to another path; that checkpoint stays as it is")
        foreign = [n for n in entries if not _ours(n)]
        if foreign:
            shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
            raise CheckpointError(f"{root} holds files save_checkpoint did not write ({shown}): give checkpoints a "
                                  "directory of their own (an empty or new one, or one save_checkpoint wrote)")
        recover(root)
        clean_stale(root)
    root.mkdir(parents=True, exist_ok=True)
    save_id = uuid.uuid4().hex[:16]
    (root / f"{TMP}{save_id}").mkdir()
    return save_id


def clean_stale(root: Path) -> None:
    """Remove the temporary and trash directories of saves that were killed (never what
    ``latest`` names)."""
    keep = _read_pointer(root)
    for name in os.listdir(root):
        if name.startswith((TMP, TRASH, POINTER + TMP)) and name != keep:
            _remove(root / name)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except OSError:
            pass


def digest_files(directory: Path, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """name -> {"bytes", "crc32"} of the files ``names`` in ``directory`` (read in chunks)."""
    out, buf = {}, bytearray(_CHUNK)
    view = memoryview(buf)
    for name in names:
        crc, size = 0, 0
        with open(directory / name, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                crc = zlib.crc32(view[:n], crc)
                size += n
        out[name] = {"bytes": size, "crc32": f"{crc:08x}"}
    return out


def files_of_rank(directory: Path, rank: int) -> list[str]:
    """The files DCP's rank ``rank`` wrote (``__{rank}_*``); rank 0 also the ``.metadata`` it wrote."""
    names = [n for n in os.listdir(directory) if n.startswith(f"__{rank}_")]
    return sorted(names + ([".metadata"] if rank == 0 and (directory / ".metadata").exists() else []))


def write_marker(directory: Path, marker: dict[str, Any]) -> None:
    with open(directory / MARKER, "w") as f:
        json.dump(marker, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(directory)


def publish(root: Path, save_id: str, name: str) -> None:
    """Make the complete ``.tmp-<save_id>`` the checkpoint ``name`` and what ``latest`` names."""
    tmp, final = root / f"{TMP}{save_id}", root / name
    if final.exists() or final.is_symlink():
        # the step is there already: latest moves to the new one first, so that it always names
        # a complete checkpoint (resolve finds the new one by its id after the renames)
        _write_atomically(root / POINTER, tmp.name + "\n")
        _fault_point("swap:pointer-to-new")
        _finish_swap(root, save_id, name)
    else:
        os.rename(tmp, final)
        fsync_dir(root)
        _fault_point("renamed")
        _write_atomically(root / POINTER, name + "\n")
        _fault_point("published")


def _finish_swap(root: Path, save_id: str, name: str) -> None:
    """``latest`` names ``.tmp-<save_id>``: put it in the place of ``name`` (what was there goes)."""
    tmp, final, trash = root / f"{TMP}{save_id}", root / name, root / f"{TRASH}{save_id}"
    if tmp.exists():
        if final.exists() or final.is_symlink():
            os.rename(final, trash)
            _fault_point("swap:old-moved")
        os.rename(tmp, final)
        fsync_dir(root)
        _fault_point("swap:renamed")
    _write_atomically(root / POINTER, name + "\n")
    _fault_point("published")
    _remove(trash)


def recover(root: Path) -> None:
    """Finish the publication a killed save left half done (``latest`` naming a ``.tmp-<id>``)."""
    pointer = _read_pointer(root)
    if pointer is None or not pointer.startswith(TMP):
        return
    save_id = pointer[len(TMP):]
    if (root / pointer / MARKER).is_file():
        _finish_swap(root, save_id, step_name(int(read_marker(root / pointer)["step"])))
        return
    for name in complete_checkpoints(root):
        if read_marker(root / name).get("save_id") == save_id:
            _finish_swap(root, save_id, name)
            return


def prune(root: Path, keep: int, current: str) -> list[str]:
    """Delete the complete checkpoints beyond the ``keep`` most recently saved (never ``current``);
    returns their names. Each is renamed away before it is deleted, so none is ever half there."""
    times = {n: _marker_time(root / n) for n in complete_checkpoints(root) if n != current}
    done = sorted(((t, n) for n, t in times.items() if t is not None), reverse=True)  # (an unreadable one stays)
    gone = [n for _, n in done[max(0, keep - 1):]]
    for n in gone:
        trash = root / f"{TRASH}{uuid.uuid4().hex[:16]}"
        os.rename(root / n, trash)
        _fault_point("prune:moved")
        _remove(trash)
    return gone


# ---------------------------------------------------------------------------- loading (every rank)


def complete_checkpoints(root: Path) -> list[str]:
    """The ``step-*`` directories in ``root`` that have a marker (complete saves), by name."""
    return sorted(n for n in os.listdir(root) if _STEP.match(n) and (root / n / MARKER).is_file())


def _marker_time(directory: Path) -> float | None:
    try:
        return float(read_marker(directory).get("time", 0.0))
    except (CheckpointError, TypeError, ValueError):
        return None


def _read_pointer(root: Path) -> str | None:
    try:
        return (root / POINTER).read_text().strip() or None
    except (FileNotFoundError, NotADirectoryError):
        return None


def read_marker(directory: Path) -> dict[str, Any]:
    try:
        marker = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{directory}: its completion marker {MARKER} cannot be read ({e}): the checkpoint "
                              "cannot be verified. Load an earlier one") from e
    if not isinstance(marker, dict) or marker.get("format") != "mixprec-checkpoint":
        raise CheckpointError(f"{directory}: {MARKER} is not a mixprec checkpoint marker")
    wrong = _marker_schema(marker)
    if wrong:
        raise CheckpointError(f"{directory}: its completion marker {MARKER} is malformed ({wrong}): it was edited or "
                              "damaged, so the checkpoint cannot be verified. Load an earlier one, or restore the "
                              "marker save_checkpoint wrote")
    if marker.get("layout", 0) > LAYOUT:
        raise CheckpointError(f"{directory} was written by a newer mixprec ({marker.get('mixprec')}, layout "
                              f"{marker.get('layout')}; this one reads layout {LAYOUT}): upgrade mixprec to load it")
    return marker


def _marker_schema(marker: dict[str, Any]) -> str:
    """What in a marker is not of the shape ``write_marker`` gives it ('' when all is): checked before any
    field is used, so an edited marker is a CheckpointError saying so, not an AttributeError from inside."""
    def integer(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    for key in ("layout", "step", "world_size"):
        if key in marker and not integer(marker[key]):
            return f"{key!r} must be an integer >= 0, got {marker[key]!r}"[:200]
    if "time" in marker and (isinstance(marker["time"], bool) or not isinstance(marker["time"], (int, float))):
        return f"'time' must be a number, got {marker['time']!r}"[:200]
    for key in ("save_id", "recipe", "mode", "optimizer"):
        if key in marker and not isinstance(marker[key], str):
            return f"{key!r} must be a string, got {type(marker[key]).__name__}"
    files = marker.get("files", {})
    if not isinstance(files, dict):
        return f"'files' must map each file's name to its size and CRC-32, got a {type(files).__name__}"
    for name, entry in files.items():
        if not (isinstance(entry, dict) and integer(entry.get("bytes")) and isinstance(entry.get("crc32"), str)):
            return f"the entry of file {name!r} must be {{'bytes': n, 'crc32': '8 hex digits'}}, got {entry!r}"[:200]
    return ""


def resolve(path: Path) -> Path:
    """The complete checkpoint directory that ``path`` names: a checkpoint root (its ``latest``)
    or one ``step-N`` directory in it. Raises ``CheckpointError`` saying what is there instead."""
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}: save_checkpoint(path) writes a directory there (on a file "
                              "system every rank sees)")
    if not path.is_dir():
        raise CheckpointError(f"{path} is a file, not a checkpoint: save_checkpoint writes a directory")
    if (path / MARKER).is_file():
        return path
    entries = set(os.listdir(path))
    pointer = _read_pointer(path)
    if pointer is not None:
        target = path / pointer
        if (target / MARKER).is_file():
            return target
        if pointer.startswith(TMP):  # a save was replacing a step when it stopped: find the new one by its id
            for name in complete_checkpoints(path):
                if read_marker(path / name).get("save_id") == pointer[len(TMP):]:
                    return path / name
        raise CheckpointError(f"{path}/latest names {pointer!r}, which is not a complete checkpoint. Complete "
                              f"ones here: {', '.join(complete_checkpoints(path)) or 'none'}; load one of them by its "
                              "path")
    done = complete_checkpoints(path)
    if done:  # the first save stopped between its rename and 'latest': the newest complete one
        return path / max(done, key=lambda n: _marker_time(path / n) or 0.0)
    if (path.name.startswith(TMP) or _STEP.match(path.name)) and _is_dcp_dir(entries):
        raise CheckpointError(f"{path} is an incomplete checkpoint (no {MARKER}: the save did not finish on every "
                              "rank). Load the complete one its directory's 'latest' names")
    if _is_dcp_dir(entries):
        raise CheckpointError(
            f"{path} is a torch.distributed.checkpoint directory without mixprec's completion marker "
            f"({MARKER}): written in place by an earlier mixprec, or by another tool. Whether every rank finished "
            "writing it cannot be known, so it is not loaded. Load it with the code that wrote it and save again "
            "with save_checkpoint")
    if any(n.startswith(TMP) for n in entries):
        raise CheckpointError(f"{path} holds only an incomplete save (killed before it was published): there is no "
                              "complete checkpoint to load")
    raise CheckpointError(f"{path} is not a mixprec checkpoint (no 'latest', no {MARKER}): pass the path given to "
                          "save_checkpoint, or one of its step-N directories")


def _describe(name: str) -> str:
    return "the metadata file .metadata" if name == ".metadata" else f"shard {name}"


def check_files(directory: Path, marker: dict[str, Any], checksum: Iterable[str] = ()) -> list[str]:
    """What does not match the marker's manifest: missing, truncated, grown or extra files, and
    (for the names in ``checksum``) a CRC-32 that differs. Empty when all is well."""
    files: dict[str, dict[str, Any]] = marker.get("files") or {}
    problems = []
    if not files:
        return [f"{MARKER} lists no files"]
    present = {n for n in os.listdir(directory) if n != MARKER}
    for name, want in sorted(files.items()):
        if name not in present:
            problems.append(f"{_describe(name)} is missing")
            continue
        size = (directory / name).stat().st_size
        if size < want["bytes"]:
            problems.append(f"{_describe(name)} is truncated ({size:,} of {want['bytes']:,} bytes)")
        elif size > want["bytes"]:
            problems.append(f"{_describe(name)} has grown since it was saved ({size:,} bytes, saved {want['bytes']:,}): "
                            "something wrote into this checkpoint after it was complete")
    for name in sorted(present - set(files)):
        if name.endswith(".distcp") or name == ".metadata":
            problems.append(f"{_describe(name)} was not written by this save (a mix of two saves?)")
    if not problems:
        for name, got in digest_files(directory, sorted(set(checksum) & set(files))).items():
            if got["crc32"] != files[name]["crc32"]:
                problems.append(f"{_describe(name)} has changed since it was saved: its CRC-32 ({got['crc32']}) "
                                f"differs from the one recorded then ({files[name]['crc32']})")
    return problems
