"""mixprec._files.write_aside: the new file appears whole or not at all, and nothing is left beside it."""

import os

import pytest

from mixprec._files import write_aside


def test_a_write_that_fails_midway_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "state.pt"
    path.write_bytes(b"old")

    def torn(f):
        f.write(b"half of the new")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        write_aside(path, torn)
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["state.pt"]


def test_an_interrupt_at_the_rename_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "state.pt"
    path.write_bytes(b"old")

    def interrupted(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_aside(path, lambda f: f.write(b"new"))
    monkeypatch.undo()
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["state.pt"]


def test_the_new_file_replaces_the_old_and_a_named_temporary_is_used(tmp_path, monkeypatch):
    path = tmp_path / "marker.json"
    path.write_bytes(b"old")
    seen = []
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (seen.append(os.path.basename(a)), real(a, b)))
    write_aside(path, lambda f: f.write(b"new"), tmp_name="marker.json.tmp-1")
    assert path.read_bytes() == b"new" and seen == ["marker.json.tmp-1"] and os.listdir(tmp_path) == ["marker.json"]
