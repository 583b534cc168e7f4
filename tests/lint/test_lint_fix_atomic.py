"""--fix replaces a user's file in one step: a write that fails or is interrupted part-way leaves the script
as it was (and no temporary file beside it), never half of it.

Found by review: ``lint_paths(fix=True)`` rewrote the file with ``path.write_bytes`` in place, which
truncates it first, so a full disk or a Ctrl-C mid-write destroyed the user's training script.
"""

from __future__ import annotations

import builtins
import os
import stat

import pytest

from mixprec.lint import lint_paths

SCRIPT = "import torch\ns = torch.cuda.amp.GradScaler()\nwith torch.cuda.amp.autocast():\n    pass\n"


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return path


def test_a_full_disk_mid_write_leaves_the_script_whole(script, monkeypatch):
    real_open = builtins.open

    class HalfWritten:  # the file takes the first half, then the disk is full
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            self.f.write(data[: len(data) // 2])
            raise OSError(28, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.f, name)

    def opening(file, mode="r", *a, **k):
        f = real_open(file, mode, *a, **k)
        return HalfWritten(f) if "train.py" in str(file) and ("w" in mode or "x" in mode) else f

    monkeypatch.setattr(builtins, "open", opening)
    monkeypatch.setattr(type(script), "open", lambda self, mode="r", *a, **k: opening(self, mode, *a, **k))
    with pytest.raises(OSError, match="No space left"):
        lint_paths([script], fix=True)
    monkeypatch.undo()
    assert script.read_text() == SCRIPT
    assert os.listdir(script.parent) == ["train.py"]


def test_a_ctrl_c_at_the_rename_leaves_the_script_whole(script, monkeypatch):
    def interrupted(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        lint_paths([script], fix=True)
    monkeypatch.undo()
    assert script.read_text() == SCRIPT
    assert os.listdir(script.parent) == ["train.py"]


def test_the_rewritten_file_keeps_its_permissions_and_a_symlink_stays_a_link(tmp_path, script):
    script.chmod(0o750)
    link = tmp_path / "link.py"
    link.symlink_to(script.name)
    result = lint_paths([link], fix=True)
    assert result.fixed == {str(link): 2}
    assert link.is_symlink() and "torch.cuda.amp" not in script.read_text()
    assert stat.S_IMODE(script.stat().st_mode) == 0o750
    assert sorted(os.listdir(tmp_path)) == ["link.py", "train.py"]
