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

import json
import os
import tempfile

import pyarrow.parquet as pq
import pytest
import runner_services
from conftest import snapshot
from test_runner_tier import RUN_SECONDS, assert_same_files, deadline

from madp.cli import main

RECORDS = 20_000
ROW_GROUP = 500  # the Parquet half in 20 row groups
SKIP = ["--on-invalid", "skip"]
BOUND = ["-k", "3", "--output-shards", "2", *SKIP]
BATCH = ["--steps", "30", "--batch-size", "400", "--min-sep", "3", "--output-shards", "2", "--seed", "11", *SKIP]
# Each file read in several splits (the Parquet file in 4, the JSON Lines file in 15), on 2 partitions
BEAM = ["--partitions=2", "--input-split-bytes=100000"]
# What a report says of the run and its engine rather than of the data
RUN_FACTS = ("beam_counters_per_run", "engine", "partitions", "pipeline_runs", "wall_time_s")


def invalid_rows(valid: list[dict]) -> list[dict]:
    """A row without an id, one whose users are not a list of ids, and a second row of a valid row's id."""
    return [
        {"users": [1, 2], "features": [0.0] * 4, "label": 0},
        {"id": 10**9, "users": "seven", "features": [0.0] * 4, "label": 1},
        dict(valid[3]),
    ]


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> str:
    """`madp generate`'s 20k skewed records: half as Parquet in row groups of 500, half as JSON Lines
    with invalid rows in its middle and at its end."""
    directory = tmp_path_factory.mktemp("prism-records")
    generated = str(directory / "generated.parquet")
    graph = ["--records", str(RECORDS), "--graph", "skewed", "--features", "4", "--seed", "13"]
    assert main(["-q", "generate", generated, *graph]) == 0
    table = pq.read_table(generated)
    data = str(directory / "records")
    os.mkdir(data)
    half = RECORDS // 2
    pq.write_table(table.slice(0, half), os.path.join(data, "a.parquet"), row_group_size=ROW_GROUP)
    rows = table.slice(half).to_pylist()
    bad = invalid_rows(rows)
    with open(os.path.join(data, "b.jsonl"), "w") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in [*rows[: half // 2], *bad[:2], *rows[half // 2 :], bad[2]])
    return data


@pytest.fixture(scope="module")
def local_outputs(records, tmp_path_factory) -> tuple[str, str]:
    """`--runner local`'s bound and batch outputs: what Prism must write."""
    directory = tmp_path_factory.mktemp("prism-local")
    bound, batches = str(directory / "bound"), str(directory / "batches")
    assert main(["-q", "bound", records, bound, *BOUND, "--runner", "local"]) == 0
    assert main(["-q", "batch", bound, records, batches, *BATCH, "--runner", "local"]) == 0
    return bound, batches


@pytest.fixture
def prism_options(prism_location, tmp_path, monkeypatch) -> list[str]:
    # Beam's start of Prism makes a `beam-temp*` folder in the temporary directory that nothing removes
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return ["--runner", "PrismRunner", f"--prism_location={prism_location}", "--environment_type=LOOPBACK", *BEAM]


def on_prism(args: list[str], capsys) -> None:
    """`madp ARGS` on Prism through the CLI, within the tier's deadline for a run."""
    with deadline(RUN_SECONDS, f"madp {args[0]} on Prism"):
        code = main(["-q", *args])
    assert code == 0, capsys.readouterr().err[-3000:]
    capsys.readouterr()


def assert_same_rejects_and_report(output: str, expected: str) -> None:
    rejected = snapshot(os.path.join(expected, "rejected"))
    assert rejected, "the local run rejected no row: the input's invalid rows test nothing"
    assert snapshot(os.path.join(output, "rejected")) == rejected
    report, wanted = (json.load(open(os.path.join(path, "report.json"))) for path in (output, expected))
    assert report["rejected"] == wanted["rejected"] == {"duplicate_id": 2, "missing_id": 1, "non_scalar_user": 1}
    differing = sorted(key for key in report.keys() | wanted.keys() if report.get(key) != wanted.get(key))
    assert set(differing) <= set(RUN_FACTS), f"the reports differ in {differing}"


@pytest.mark.beam
@pytest.mark.runners
def test_bound_on_prism_writes_the_local_selection_and_rejects(prism_options, records, local_outputs, tmp_path, capsys):
    bound, _ = local_outputs
    output = str(tmp_path / "bound")
    on_prism(["bound", records, output, *BOUND, *prism_options], capsys)
    assert_same_files(os.path.join(output, "selected"), os.path.join(bound, "selected"), ".parquet")
    assert_same_rejects_and_report(output, bound)


@pytest.mark.beam
@pytest.mark.runners
def test_batch_on_prism_writes_the_local_batches_and_rejects(prism_options, records, local_outputs, tmp_path, capsys):
    bound, batches = local_outputs
    output = str(tmp_path / "batches")
    on_prism(["batch", bound, records, output, *BATCH, *prism_options], capsys)
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
