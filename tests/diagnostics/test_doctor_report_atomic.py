"""doctor's report is published as a set: a write that fails or is interrupted part-way leaves the earlier
report whole (every file as it was, no temporary file left), never new files beside old ones.

The same fault ``mixprec compare`` had: doctor wrote its PNGs, then doctor.html, then doctor.json one by
one in place, so a Ctrl-C or a full disk at the HTML left the new run's figures beside the old run's
page and JSON, a mixed set that looked complete.
"""

from __future__ import annotations

import builtins
import dataclasses
import json
import os

import pytest

from mixprec.diagnostics.doctor import doctor

from . import zoo


def _contents(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def two_runs():
    """Two doctor runs whose every file differs: the old report on disk, the new one written over it."""
    old = doctor(zoo.make_healthy_mlp(), device="cpu", steps=2)
    new = doctor(zoo.make_deep_narrow(), device="cpu", steps=2)
    return old, new


@pytest.fixture
def old_report(tmp_path, two_runs):
    out = tmp_path / "report"
    two_runs[0].write(out)
    return out, _contents(out)


@pytest.mark.parametrize("failing_file", ["grad_underflow.png", "doctor.html", "doctor.json"])
def test_a_write_error_leaves_the_old_report_whole(old_report, two_runs, monkeypatch, failing_file):
    out, before = old_report
    real_open = builtins.open

    def failing(file, mode="r", *a, **k):
        if failing_file in str(file) and "w" in mode:
            raise OSError(28, "No space left on device")
        return real_open(file, mode, *a, **k)

    monkeypatch.setattr(builtins, "open", failing)
    with pytest.raises(OSError, match="No space left"):
        two_runs[1].write(out)
    assert _contents(out) == before


@pytest.mark.parametrize("at", [1, 3, 6, 8, 12, 14])
def test_a_ctrl_c_at_any_rename_leaves_the_old_report_whole(old_report, two_runs, monkeypatch, at):
    """KeyboardInterrupt at the at-th rename (7 old files moved aside, then 7 new ones in)."""
    out, before = old_report
    real_replace, calls = os.replace, []

    def interrupted(src, dst):
        calls.append(dst)
        if len(calls) == at:
            raise KeyboardInterrupt
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        two_runs[1].write(out)
    monkeypatch.setattr(os, "replace", real_replace)
    assert _contents(out) == before


def test_a_ctrl_c_while_rendering_changes_nothing(old_report, two_runs, monkeypatch):
    # every file is rendered in memory before the directory is touched
    out, before = old_report
    import mixprec.report.html as html

    monkeypatch.setattr(html.HtmlReport, "render", lambda self: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        two_runs[1].write(out)
    assert _contents(out) == before


def test_the_json_is_renamed_in_last_and_a_success_leaves_only_the_new_set(old_report, two_runs, monkeypatch):
    out, _ = old_report
    real_replace, placed = os.replace, []
    monkeypatch.setattr(os, "replace", lambda src, dst: (placed.append(os.path.basename(dst)), real_replace(src, dst))[1])
    written = two_runs[1].write(out)
    into_place = [n for n in placed if not n.startswith(".")]
    assert into_place[-1] == "doctor.json" and sorted(into_place) == sorted(written)
    assert sorted(p.name for p in out.iterdir()) == sorted(written)
    assert json.loads((out / "doctor.json").read_text())["task"] == two_runs[1].task


def test_an_earlier_doctors_figure_this_run_has_none_of_leaves_with_the_old_set(old_report, two_runs):
    out, before = old_report
    assert "update_vanishing.png" in before
    new = two_runs[1]
    fewer = dataclasses.replace(new, evidence=dataclasses.replace(new.evidence, updates=None))
    written = fewer.write(out)
    assert "update_vanishing.png" not in written
    assert sorted(p.name for p in out.iterdir()) == sorted(written)  # not the old run's figure beside the new page


def test_a_directory_where_a_file_goes_is_refused_and_nothing_changes(old_report, two_runs):
    out, _ = old_report
    (out / "loss_scale.png").unlink()
    (out / "loss_scale.png").mkdir()
    (out / "loss_scale.png" / "mine.txt").write_text("mine")
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    with pytest.raises(IsADirectoryError, match="is a directory"):
        two_runs[1].write(out)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert (out / "loss_scale.png" / "mine.txt").read_text() == "mine"
