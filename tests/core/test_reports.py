"""The typed contracts between stages: the bound and batch reports and metrics.json read back as they were
written, a report without a format_version read as its predecessor, and a newer one refused naming the file."""

from __future__ import annotations

import json

import pytest
from conftest import write_records

from madp.cli import main
from madp.core.batch_files import read_batch_report
from madp.core.errors import InputError
from madp.core.reports import BatchReport, BoundReport
from madp.core.selection import read_bound_report
from madp.training.outputs import Evaluations, TrainingMetrics, read_metrics, write_metrics


@pytest.fixture
def outputs(tmp_path, capsys):
    """A seeded `madp bound` and `madp batch` (padded to B_max) of a small graph: their OUTPUT folders."""
    data = write_records(
        str(tmp_path / "d.jsonl"), [{"id": i, "users": [i % 90, 1000 + i % 80], "x": float(i)} for i in range(400)]
    )
    bound, batches = tmp_path / "bound", tmp_path / "batches"
    assert main(["-q", "bound", data, str(bound), "-k", "3", "--runner", "local"]) == 0
    batch = ["--steps", "20", "--batch-size", "8", "--min-sep", "2", "--max-batch-size", "12", "--seed", "1"]
    assert main(["-q", "batch", str(bound), data, str(batches), *batch, "--runner", "local"]) == 0
    capsys.readouterr()
    return bound, batches


def test_the_reports_read_back_as_written(outputs):
    bound, batches = outputs
    for path, read in ((bound, read_bound_report), (batches, read_batch_report)):
        written = json.loads((path / "report.json").read_text())
        report = read(str(path))
        assert written["format_version"] == 1
        assert report.to_json() == written  # every key, nested ones too
        assert type(report).from_json(json.loads(json.dumps(report.to_json())), "report.json") == report
    report = read_batch_report(str(batches))
    assert report.bound is not None and report.bound.selection_files == read_bound_report(str(bound)).selection_files
    assert report.max_rows_per_step == 12 and report.rows_per_step == [12] * 20


@pytest.mark.parametrize("read, what", [(read_bound_report, "bound"), (read_batch_report, "batches")])
def test_a_report_without_format_version_is_its_predecessor(outputs, read, what):
    path = outputs[0] if what == "bound" else outputs[1]
    current = read(str(path))
    written = json.loads((path / "report.json").read_text())
    del written["format_version"]
    (path / "report.json").write_text(json.dumps(written))
    assert read(str(path)) == current


@pytest.mark.parametrize("version", [2, "1", None, 0])
def test_a_report_of_an_unknown_format_version_is_refused_naming_the_file(outputs, version):
    for path, read in ((outputs[0], read_bound_report), (outputs[1], read_batch_report)):
        written = json.loads((path / "report.json").read_text())
        (path / "report.json").write_text(json.dumps({**written, "format_version": version}))
        with pytest.raises(InputError, match=f"{path / 'report.json'}: format_version {version!r} is not one"):
            read(str(path))


def test_a_batch_of_a_newer_bound_report_is_refused(outputs, capsys, tmp_path):
    bound, _ = outputs
    written = json.loads((bound / "report.json").read_text())
    (bound / "report.json").write_text(json.dumps({**written, "format_version": 2}))
    argv = ["batch", str(bound), str(tmp_path / "d.jsonl"), str(tmp_path / "again"), "--steps", "3"]
    assert main([*argv, "--batch-size", "5", "--runner", "local"]) == 2
    assert "format_version 2 is not one this madp reads" in capsys.readouterr().err


def test_a_report_that_is_no_report_names_its_file():
    with pytest.raises(InputError, match="r.json is not a madp batch report"):
        BatchReport.from_json([1], "r.json")
    with pytest.raises(InputError, match=r"r.json lacks \['engine'"):
        BoundReport.from_json({"selection_files": [{"name": "a", "bytes": 1, "sha256": "0"}]}, "r.json")


def test_metrics_read_back_as_written(tmp_path):
    point = {"step": 10, "loss": 0.5, "accuracy": 0.8}
    published = {"batches": "b", "model": "logreg", "eval_data_public": True, "eval": [point], "final": point}
    metrics = TrainingMetrics.from_json(published, "metrics.json")
    assert metrics.eval_data_public and metrics.evaluations == Evaluations((point,), point)
    write_metrics(str(tmp_path), metrics)
    written = json.loads((tmp_path / "metrics.json").read_text())
    assert written == {"format_version": 1, **published} and list(written)[1:] == list(published)
    assert read_metrics(str(tmp_path)) == metrics
    internal = {"model": "causal-lm", "lora_rank": 8, "evaluation": "out/internal/evaluation.json (internal)"}
    kept = TrainingMetrics.from_json(internal, "metrics.json")
    assert kept.evaluations is None and not kept.eval_data_public
    assert kept.to_json() == {"format_version": 1, **internal}
    (tmp_path / "metrics.json").write_text(json.dumps({**published, "format_version": 2}))
    with pytest.raises(InputError, match="metrics.json: format_version 2 is not one"):
        read_metrics(str(tmp_path))
