"""The report files: they exist, the PNG decodes at the expected size, the JSON holds the curves,
the HTML embeds the plot and states the rule; and the output directory is not clobbered."""

from __future__ import annotations

import base64
import csv
import json
import re
from pathlib import Path

import pytest

from mixprec.comparison.report import FILES, check_out_dir, print_summary, write_report
from mixprec.report.compare_plots import DPI, HEIGHT_IN, WIDTH_IN


def test_all_four_files_are_written(healthy_comparison):
    files = healthy_comparison.files
    assert set(files) == set(FILES)
    for path in files.values():
        assert Path(path).is_file() and Path(path).stat().st_size > 0


def test_png_decodes_to_the_expected_size(healthy_comparison):
    import matplotlib.image as mpimg

    image = mpimg.imread(healthy_comparison.files["png"])
    assert image.shape[:2] == (int(HEIGHT_IN * DPI), int(WIDTH_IN * DPI))
    assert image.std() > 0.05  # not a blank canvas


def test_json_holds_every_curve_and_the_verdicts(healthy_comparison):
    data = json.loads(Path(healthy_comparison.files["json"]).read_text())
    steps = healthy_comparison.steps
    assert data["mixprec_compare"] == 1 and data["ok"] is True
    assert [r["label"] for r in data["runs"]] == [r.label for r in healthy_comparison.runs]
    for run, obj in zip(healthy_comparison.runs, data["runs"]):
        for key in ("loss", "grad_norm", "scale", "skipped", "step_time_s"):
            assert len(obj["curves"][key]) == steps
        assert obj["curves"]["loss"] == pytest.approx(run.loss.tolist())
    assert data["verdicts"]["bf16-mixed"]["status"] == "TRACKS"
    assert len(data["band"]["width"]) == steps
    assert data["rule"]["span"] == healthy_comparison.rule.resolve(steps).span and "DIVERGES" in data["rule"]["text"]
    assert set(data["step_time_ratio_vs_fp32"]) == {"fp32", "bf16-mixed", "fp16-mixed"}


def test_json_is_strict_even_with_non_finite_losses(healthy_comparison):
    import numpy as np

    run = healthy_comparison.runs[-1]
    saved = run.loss.copy()
    try:
        run.loss[3] = np.nan
        text = healthy_comparison.to_json()
    finally:
        run.loss[:] = saved
    def refuse(constant):
        raise AssertionError(f"non-standard JSON constant {constant}")

    assert json.loads(text, parse_constant=refuse)["runs"][-1]["curves"]["loss"][3] is None


def test_csv_has_one_row_per_run_and_step(healthy_comparison):
    with open(healthy_comparison.files["csv"], newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(healthy_comparison.runs) * healthy_comparison.steps
    first = rows[0]
    assert first["run"] == "fp32" and first["step"] == "1"
    assert float(first["loss"]) == pytest.approx(float(healthy_comparison.reference.loss[0]))


def test_html_embeds_the_png_and_states_the_rule(healthy_comparison):
    html = Path(healthy_comparison.files["html"]).read_text()
    match = re.search(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    assert match, "no embedded PNG"
    assert base64.b64decode(match.group(1)) == Path(healthy_comparison.files["png"]).read_bytes()
    assert "TRACKS" in html and "fp16-mixed" in html
    assert healthy_comparison.rule.describe(healthy_comparison.steps).split(".")[0] in html


def test_terminal_summary_lists_verdicts_and_ratios(healthy_comparison):
    from rich.console import Console

    console = Console(record=True, width=140)
    print_summary(healthy_comparison, console)
    text = console.export_text()
    for fragment in ("bf16-mixed", "fp16-mixed", "TRACKS", "reference", "vs fp32", "rule:", "compare.html"):
        assert fragment in text


def test_refuses_to_overwrite_files_it_did_not_write(tmp_path, healthy_comparison):
    foreign = tmp_path / "compare.html"
    foreign.write_text("someone's page")
    with pytest.raises(FileExistsError, match="not written by 'mixprec compare'"):
        check_out_dir(tmp_path)
    with pytest.raises(FileExistsError):
        write_report(healthy_comparison, tmp_path)
    assert foreign.read_text() == "someone's page"


def test_rewrites_its_own_report_and_refuses_a_file_as_directory(tmp_path, healthy_comparison):
    out = tmp_path / "r"
    files = write_report(healthy_comparison, out)
    files_again = write_report(healthy_comparison, out)  # its own files: replaced
    assert files == files_again and healthy_comparison.files != files  # the result object is untouched
    assert json.loads((out / "compare.json").read_text())["files"] == files
    with pytest.raises(FileExistsError, match="is a file"):
        check_out_dir(out / "compare.json")


def test_an_out_dir_that_cannot_be_created_or_written_is_refused_before_training(tmp_path, monkeypatch):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="cannot be created: .*notes.txt' is a file"):
        check_out_dir(tmp_path / "notes.txt" / "report")  # mkdir would fail only after every run
    check_out_dir(tmp_path / "new" / "report")  # missing directories are fine: they are created
    monkeypatch.setattr("os.access", lambda path, mode: False)  # a read-only place (tests may run as root)
    with pytest.raises(PermissionError, match="no write permission in"):
        check_out_dir(tmp_path / "new" / "report")
    assert (tmp_path / "notes.txt").read_text() == "mine" and not (tmp_path / "new").exists()
