"""On Beam's Prism runner (`--runner PrismRunner --prism_location PATH --environment_type LOOPBACK`: a
Go binary built once per Beam version, SDK workers in this process), `madp bound` and `madp batch`
write the same selection shards, batch files, schema.json and rejected rows, byte for byte, and the
same reports but for what they say of the engine and the run (partitions, pipeline runs, Beam counters,
wall time), as `--runner local`: on 20k skewed records, a Parquet file of many row groups and a JSON
Lines file with invalid rows, each read in several splits.

The Prism binary comes from runner_services.prism_binary (`make prism` builds it before `make test`);
without Go the tier skips, but fails under CI.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import runner_services
from conftest import (
    TIER_BATCH,
    TIER_BOUND,
    TIER_SPLITS,
    assert_same_rejects_and_report,
)
from test_runner_tier import RUN_SECONDS, assert_same_files, deadline

from madp.cli import main


@pytest.fixture
def prism_options(prism_location, tmp_path, monkeypatch) -> list[str]:
    # Beam's start of Prism makes a `beam-temp*` folder in the temporary directory that nothing removes
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return [
        "--runner",
        "PrismRunner",
        f"--prism_location={prism_location}",
        "--environment_type=LOOPBACK",
        *TIER_SPLITS,
    ]


def on_prism(args: list[str], capsys) -> None:
    """`madp ARGS` on Prism through the CLI, within the tier's deadline for a run."""
    with deadline(RUN_SECONDS, f"madp {args[0]} on Prism"):
        code = main(["-q", *args])
    assert code == 0, capsys.readouterr().err[-3000:]
    capsys.readouterr()


@pytest.mark.beam
@pytest.mark.runners
def test_bound_on_prism_writes_the_local_selection_and_rejects(
    prism_options, tier_records, tier_local_outputs, tmp_path, capsys
):
    from apache_beam.options.pipeline_options import PipelineOptions
    from apache_beam.runners.portability.prism_runner import PrismRunner

    # Beam shares one Prism job server per process, made with the options of the first job that asks for
    # it (as a Beam DirectRunner job does, without --prism_location): madp's Prism jobs start their own
    PrismRunner().default_job_server(PipelineOptions([]))
    bound, _ = tier_local_outputs
    output = str(tmp_path / "bound")
    on_prism(["bound", tier_records, output, *TIER_BOUND, *prism_options], capsys)
    assert_same_files(os.path.join(output, "selected"), os.path.join(bound, "selected"), ".parquet")
    assert_same_rejects_and_report(output, bound)


@pytest.mark.beam
@pytest.mark.runners
def test_batch_on_prism_writes_the_local_batches_and_rejects(
    prism_options, tier_records, tier_local_outputs, tmp_path, capsys
):
    bound, batches = tier_local_outputs
    output = str(tmp_path / "batches")
    on_prism(["batch", bound, tier_records, output, *TIER_BATCH, *prism_options], capsys)
    assert_same_files(output, batches, ".tfrecord")
    assert_same_files(output, batches, "schema.json")
    assert_same_rejects_and_report(output, batches)


def test_a_cached_prism_binary_is_taken_without_go(tmp_path, monkeypatch):
    monkeypatch.setenv(runner_services.PRISM_CACHE_VARIABLE, str(tmp_path))
    monkeypatch.setenv("PATH", "")  # no go: the cache alone answers
    binary = tmp_path / "2.77.0" / "prism"
    binary.parent.mkdir()
    binary.write_bytes(b"")
    binary.chmod(0o755)
    assert runner_services.prism_binary("2.77.0") == str(binary)


def test_prism_without_go_is_unavailable_and_builds_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(runner_services.PRISM_CACHE_VARIABLE, str(tmp_path))
    monkeypatch.setenv("PATH", "")
    with pytest.raises(runner_services.EngineUnavailable, match=r"no `go` on PATH .*prism@v2\.77\.0"):
        runner_services.prism_binary("2.77.0")
    assert os.listdir(tmp_path) == []
