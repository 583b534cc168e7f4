"""The report is published as a set: a write that fails or is interrupted part-way leaves the earlier
report whole (every file as it was, no temporary file left), never new files beside old ones.

Found by a probe: ``mixprec compare`` wrote compare.png, .json, .csv, .html one by one in place, so a
Ctrl-C or a write error at the CSV left the new run's PNG and JSON beside the old run's CSV and HTML.
"""

from __future__ import annotations

import builtins
import dataclasses
import json
import os

import pytest

from mixprec.report.publish import publish_files
from mixprec.comparison.report import FILES, write_report


def _contents(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.fixture
def old_report(tmp_path, healthy_comparison):
    out = tmp_path / "report"
    write_report(healthy_comparison, out)
    return out, _contents(out)


def _newer(result):
    # another run's numbers: every file differs from the old one's
    runs = [dataclasses.replace(r, loss=r.loss + 0.25) for r in result.runs]
    return dataclasses.replace(result, wall_s=result.wall_s + 1234.0, runs=runs)


@pytest.mark.parametrize("failing_file", ["compare.csv", "compare.html", "compare.json"])
def test_a_write_error_leaves_the_old_report_whole(old_report, healthy_comparison, monkeypatch, failing_file):
    out, before = old_report
    real_open = builtins.open

    def failing(file, mode="r", *a, **k):
        if failing_file in str(file) and "w" in mode:
            raise OSError(5, "Input/output error")
        return real_open(file, mode, *a, **k)

    monkeypatch.setattr(builtins, "open", failing)
    with pytest.raises(OSError, match="Input/output error"):
        write_report(_newer(healthy_comparison), out)
    assert _contents(out) == before


@pytest.mark.parametrize("at", [1, 2, 3, 4, 5, 6, 7, 8])
def test_a_ctrl_c_at_any_rename_leaves_the_old_report_whole(old_report, healthy_comparison, monkeypatch, at):
    """A fault as it happens: KeyboardInterrupt at the at-th rename (moving old files aside, new ones in)."""
    out, before = old_report
    real_replace, calls = os.replace, []

    def interrupted(src, dst):
        calls.append(dst)
        if len(calls) == at:
            raise KeyboardInterrupt
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_report(_newer(healthy_comparison), out)
    monkeypatch.setattr(os, "replace", real_replace)
    assert _contents(out) == before


def test_the_json_is_renamed_in_last_and_a_success_leaves_only_the_new_set(old_report, healthy_comparison, monkeypatch):
    out, _ = old_report
    real_replace, placed = os.replace, []
    monkeypatch.setattr(os, "replace", lambda src, dst: (placed.append(os.path.basename(dst)), real_replace(src, dst))[1])
    write_report(_newer(healthy_comparison), out)
    into_place = [n for n in placed if n in FILES.values()]
    assert into_place[-1] == FILES["json"] and sorted(into_place) == sorted(FILES.values())
    assert sorted(p.name for p in out.iterdir()) == sorted(FILES.values())
    assert json.loads((out / FILES["json"]).read_text())["wall_s"] == pytest.approx(healthy_comparison.wall_s + 1234.0)


def test_publish_files_into_an_empty_directory_and_a_failure_there_leaves_it_empty(tmp_path, monkeypatch):
    publish_files(tmp_path, {"a.txt": "one", "m.json": b"{}"}, last="m.json")
    assert _contents(tmp_path) == {"a.txt": b"one", "m.json": b"{}"}
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    with pytest.raises(OSError, match="No space left"):
        publish_files(empty, {"a.txt": "one", "m.json": b"{}"}, last="m.json")
    assert list(empty.iterdir()) == []
