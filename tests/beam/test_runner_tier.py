"""On Beam's PortableRunner (the Python job service, SDK workers in processes an external worker pool
starts), `madp bound` and `madp batch` write the same selection and batch files, byte for byte, as
`--runner local`, each input file (Parquet and JSON Lines) read in several splits. The DirectRunner's
agreement is tested in test_engines_agree.py, test_runners.py and test_input_splits.py.

Each run has a deadline: a runner that hangs or whose graph explodes fails its test with a
TimeoutError instead of holding the tier, which must stay within a few minutes on two cores.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import uuid

import pyarrow.parquet as pq
import pytest
import runner_services

from madp.cli import main
from madp.tools.data.synthetic import GraphSpec, generate, to_table

pytestmark = [pytest.mark.beam, pytest.mark.runners]

RECORDS = 20_000
PARTITIONS = "2"
SPLIT = "--input-split-bytes=200000"  # each input file read in several splits
BOUND = ["-k", "3", "--output-shards", "2"]
BATCH = ["--steps", "30", "--batch-size", "400", "--min-sep", "3", "--output-shards", "2", "--seed", "11"]
RUN_SECONDS = 180  # a hung run fails instead of blocking CI; ~10-30 times a run on a 2-core machine


@contextlib.contextmanager
def deadline(seconds: float, what: str):
    """TimeoutError in this (the main) thread once `seconds` have passed; SIGALRM interrupts the
    driver wherever it waits, building a graph or waiting on the runner."""

    def expire(signum, frame):
        raise TimeoutError(f"{what} took more than {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def madp(args: list[str], capsys) -> None:
    """`madp ARGS` through the CLI, within the deadline."""
    with deadline(RUN_SECONDS, f"madp {args[0]} on the PortableRunner"):
        code = main(["-q", *args])
    assert code == 0, capsys.readouterr().err[-3000:]
    capsys.readouterr()


def files_of(directory: str, suffix: str) -> dict[str, bytes]:
    return {
        name: open(os.path.join(directory, name), "rb").read()
        for name in sorted(os.listdir(directory))
        if name.endswith(suffix)
    }


def assert_same_files(output: str, expected: str, suffix: str) -> None:
    written, wanted = files_of(output, suffix), files_of(expected, suffix)
    assert wanted, f"the local run wrote no {suffix} file"
    assert sorted(written) == sorted(wanted)
    differing = [name for name in wanted if written[name] != wanted[name]]
    assert not differing, f"{differing} differ from --runner local's"


@pytest.fixture(scope="module")
def local_outputs(tmp_path_factory):
    """The records, and `--runner local`'s selection and batches: what every runner must write."""
    directory = tmp_path_factory.mktemp("local")
    data = str(directory / "records")
    os.mkdir(data)
    table = to_table(generate(GraphSpec(records=RECORDS, features=4, seed=13)))
    half = RECORDS // 2  # a Parquet file of 5 row groups and a JSON Lines file: both read in splits
    pq.write_table(table.slice(0, half), os.path.join(data, "a.parquet"), row_group_size=half // 5)
    with open(os.path.join(data, "b.jsonl"), "w") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in table.slice(half).to_pylist())
    bound, batches = str(directory / "bound"), str(directory / "batches")
    assert main(["-q", "bound", data, bound, *BOUND, "--runner", "local"]) == 0
    assert main(["-q", "batch", bound, data, batches, *BATCH, "--runner", "local"]) == 0
    return data, bound, batches


@pytest.fixture(scope="session")
def portable_options():
    with runner_services.portable_services() as options:
        yield options


@pytest.fixture
def runner_options(portable_options):
    """The PortableRunner's Beam options."""
    return [*portable_options, f"--partitions={PARTITIONS}", SPLIT]


def test_bound_writes_the_local_selection(runner_options, local_outputs, tmp_path, capsys):
    data, bound, _ = local_outputs
    output = str(tmp_path / "bound")
    madp(["bound", data, output, *BOUND, *runner_options], capsys)
    assert_same_files(os.path.join(output, "selected"), os.path.join(bound, "selected"), ".parquet")


def test_batch_writes_the_local_batches(runner_options, local_outputs, tmp_path, capsys):
    data, bound, batches = local_outputs
    output = str(tmp_path / "batches")
    madp(["batch", bound, data, output, *BATCH, *runner_options], capsys)
    assert_same_files(output, batches, ".tfrecord")


def test_ones_own_rows_in_ones_own_pipeline_give_the_local_results(runner_options, tmp_path):
    """The exported transforms on rows that are not madp's, with their extractors, in a pipeline of
    one's own: the in-memory engines' selection and batch rows on the same records in a file."""
    import apache_beam as beam
    from test_beam_transforms import EXTRACTORS, local_results, ones_own_rows

    from madp.beam import BoundContributions, MinSepSample, files
    from madp.beam.pipeline import pipeline_options, run
    from madp.core.selection import BoundOptions
    from madp.engines.batching import BatchOptions

    rows = ones_own_rows(2_000, seed=5, users=4_000)
    bound_options = BoundOptions(max_contributions=2, on_invalid="skip")
    options = BatchOptions(seed=4, steps=30, batch_size=40, min_sep=2, on_invalid="skip")
    expected_selection, expected_rows = local_results(rows, tmp_path, bound_options, options)
    found = str(tmp_path / "found")

    def write(prefix: str, pairs) -> None:  # several elements per shard or batch file: a file each
        files.write_bytes(f"{found}/{prefix}{uuid.uuid4().hex}", json.dumps(sorted(pairs)).encode())

    pipeline = beam.Pipeline(options=pipeline_options(runner_options))
    records = pipeline | beam.Create(rows)
    bound = records | BoundContributions(bound_options, partitions=2, extractors=EXTRACTORS)
    sampled = (records, bound.shards) | MinSepSample(options, 2, extractors=EXTRACTORS)
    _ = bound.shards | "WriteSelection" >> beam.MapTuple(
        lambda _, table: write("selection-", zip(table["id"].to_pylist(), table["copies"].to_pylist()))
    )
    _ = sampled.rows | "WriteRows" >> beam.MapTuple(
        lambda _, file_rows: write("rows-", zip(file_rows.steps.tolist(), file_rows.ids.to_pylist()))
    )
    with deadline(RUN_SECONDS, "a pipeline of one's own on the PortableRunner"):
        run(pipeline, "madp", str(tmp_path / "errors"))

    def found_pairs(prefix: str) -> list[tuple[int, int]]:
        paths = [os.path.join(found, name) for name in os.listdir(found) if name.startswith(prefix)]
        return sorted(tuple(pair) for path in paths for pair in json.load(open(path)))

    assert found_pairs("selection-") == expected_selection
    assert found_pairs("rows-") == expected_rows


MONTE_CARLO = [
    "--mechanism", "bandmf-minsep", "--steps", "40", "--sampling-prob", "0.05", "--min-sep", "3", "--bands", "2",
    "-k", "2", "--epsilon", "2", "--delta", "1e-3", "--seed", "5",
]  # fmt: skip


@pytest.fixture
def accounting_runner(portable_options):
    """`madp calibrate`'s Beam options on the PortableRunner (its Monte Carlo chunks are a pipeline per wave)."""
    return ["--runner", "PortableRunner", *portable_options]


def test_monte_carlo_calibration_releases_the_local_sigma(accounting_runner, capsys, tmp_path, monkeypatch):
    """Every chunk is seeded by its place and read in seed order, so a calibration on a runner estimates,
    verifies and releases what the local one does, sample for sample."""
    monkeypatch.setenv("MADP_ATTEMPTS_LEDGER", str(tmp_path / "attempts.jsonl"))
    assert main(["-q", "calibrate", *MONTE_CARLO]) == 0
    local = json.loads(capsys.readouterr().out)
    with deadline(RUN_SECONDS, "madp calibrate on the PortableRunner"):
        code = main(["-q", "calibrate", *MONTE_CARLO, *accounting_runner])
    assert code == 0, capsys.readouterr().err[-3000:]
    remote = json.loads(capsys.readouterr().out)
    assert local["verified"] and len(local["samples_used"]) >= 1
    for key in ("noise_multiplier", "estimated_noise_multiplier", "ladder", "outcomes", "samples_used"):
        assert remote[key] == local[key], key
