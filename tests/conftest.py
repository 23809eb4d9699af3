"""Shared helpers of the suite (small graphs written as input files, crashes, snapshots), the runner
tier's engines as session fixtures (the Prism binary, a Spark standalone cluster) with its records and
their local outputs, and the suite's layout: tests/ mirrors the packages (core, accounting, beam,
training, tools), spark/ runs on the Spark cluster; properties/ holds the guarantee, hostile-input,
engines-agree and layering suites, e2e/ the command-line runs of whole jobs, docs/ the documentation site's
build, its generated reference and its pages' code blocks. Under CI=true a skipped
test fails the run (ci_skips)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
from typing import NoReturn

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from ci_skips import register as register_ci_skips

TESTS = os.path.dirname(os.path.abspath(__file__))
# Test modules import shared helpers (`from conftest import ...`, `from reference import ...`) and each
# other's (`from test_batching import rows_of`) by their file's name, the name pytest imports them under
# (test folders are not packages, and file names are unique across them).
SUITES = ("core", "accounting", "beam", "spark", "training", "tools", "properties", "e2e", "docs")
sys.path[:0] = [TESTS, *(os.path.join(TESTS, suite) for suite in SUITES)]
ROOT = os.path.dirname(TESTS)  # the repository
DATA = os.path.join(TESTS, "data")  # fixture files
# As madp.training.load_tensorflow sets it, for the test modules that import Keras 3 (and with it
# TensorFlow) before madp: TensorFlow reads it when it is imported.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")


# The longest test files (one to four minutes each on 2 cores), started first: under `--dist loadfile` a
# file runs whole on one worker, and a long one started last would run alone while the other workers idle.
LONGEST_FIRST = (
    "training/test_pretrained.py",
    "docs/test_code_blocks.py",
    "spark/test_spark_cluster.py",
    "properties/test_privacy_guarantee.py",
    "training/test_text.py",
    "tools/test_planning.py",
    "spark/test_dataframe.py",
    "tools/test_audit.py",
    "beam/test_runner_tier.py",
    "accounting/test_accounting.py",
)


def pytest_configure(config):
    register_ci_skips(config)


def pytest_collection_modifyitems(items):
    first = {os.path.join(TESTS, name): rank for rank, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(str(item.path), len(first)))  # stable: the rest in their order


def write_records(path: str, rows: list[dict]) -> str:
    """Rows as a .jsonl or .parquet file."""
    if path.endswith(".jsonl"):
        with open(path, "w") as handle:
            handle.writelines(json.dumps(row) + "\n" for row in rows)
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def held_by(pid: int, command: str) -> str:
    """The text of an output's lock (or a reader's mark) as madp process `pid` on this host writes it."""
    return json.dumps({"pid": pid, "host": socket.gethostname(), "command": command, "since": "now"})


@pytest.fixture
def other_process():
    """The pid of another live process: a lock or a reader's mark it holds is neither this process's nor stale."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield process.pid
    process.kill()
    process.wait()


def graph_rows(offsets: np.ndarray, users: np.ndarray, ids=None) -> list[dict]:
    ids = list(range(len(offsets) - 1)) if ids is None else ids
    return [{"id": ids[i], "users": users[offsets[i] : offsets[i + 1]].tolist()} for i in range(len(offsets) - 1)]


@pytest.fixture
def small_graph():
    from madp.tools.data.synthetic import GraphSpec, generate

    data = generate(GraphSpec(records=3000, graph="skewed", records_per_user=3.0, seed=7))
    return graph_rows(data.offsets, data.users)


def engine_unavailable(reason: str) -> NoReturn:
    """Skip a runner-tier test whose engine this machine lacks, but fail it under CI (CI=true), where the
    tier must run."""
    import runner_services

    if runner_services.tier_required():
        pytest.fail(f"{reason}: CI runs the runner tier (CI=true)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def prism_location() -> str:
    """The path of Beam's Prism runner for the installed Beam, from its cache or built there (`make
    prism` builds it before the tests, runner_services.prism_binary)."""
    import runner_services

    try:
        return runner_services.prism_binary()
    except runner_services.EngineUnavailable as missing:
        engine_unavailable(str(missing))


@pytest.fixture(scope="session")
def spark_cluster():
    """A Spark standalone cluster for the session: a master and two workers of one core and 2 GB each,
    on loopback, stopped with all its processes at the end (madp.tools.spark_standalone.spark_cluster,
    run with the services' environment). A failing test that uses it shows the end of the cluster's logs."""
    import runner_services

    from madp.tools import spark_standalone

    if importlib.util.find_spec("pyspark") is None:
        engine_unavailable("pyspark is not installed (pip install -e '.[spark]')")
    if shutil.which("java") is None:
        engine_unavailable("no `java` on PATH to run a Spark cluster (Java 17 or newer)")
    with spark_standalone.spark_cluster(environment=runner_services.service_environment()) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def spark_master(spark_cluster) -> str:
    """The URL of the session's Spark cluster (spark://127.0.0.1:PORT)."""
    return spark_cluster.master_url


# The runner tier's data set and what it checks on every engine (Prism, tests/beam/test_prism_tier.py;
# Spark's standalone cluster, tests/spark/test_spark_cluster.py): `madp generate`'s 20k skewed records,
# a Parquet file of many row groups and a JSON Lines file with invalid rows, each read in several splits.
TIER_RECORDS = 20_000
TIER_ROW_GROUP = 500  # the Parquet half in 20 row groups
TIER_SKIP = ["--on-invalid", "skip"]
TIER_BOUND = ["-k", "3", "--output-shards", "2", *TIER_SKIP]
TIER_BATCH = ["--steps", "30", "--batch-size", "400", "--min-sep", "3", "--output-shards", "2", "--seed", "11"]
TIER_BATCH += TIER_SKIP
# Each file read in several splits (the Parquet file in 4, the JSON Lines file in 15), on 2 partitions
TIER_SPLITS = ["--partitions=2", "--input-split-bytes=100000"]
# What a report says of the run and its engine rather than of the data
RUN_FACTS = ("beam_counters_per_run", "engine", "partitions", "pipeline_runs", "spark_faults", "wall_time_s")


def invalid_rows(valid: list[dict]) -> list[dict]:
    """A row without an id, one whose users are not a list of ids, and a second row of a valid row's id."""
    return [
        {"users": [1, 2], "features": [0.0] * 4, "label": 0},
        {"id": 10**9, "users": "seven", "features": [0.0] * 4, "label": 1},
        dict(valid[3]),
    ]


@pytest.fixture(scope="session")
def tier_records(tmp_path_factory) -> str:
    """The runner tier's records: half as Parquet in row groups of 500, half as JSON Lines with invalid
    rows in its middle and at its end."""
    from madp.cli import main

    directory = tmp_path_factory.mktemp("tier-records")
    generated = str(directory / "generated.parquet")
    graph = ["--records", str(TIER_RECORDS), "--graph", "skewed", "--features", "4", "--seed", "13"]
    assert main(["-q", "generate", generated, *graph]) == 0
    table = pq.read_table(generated)
    data = str(directory / "records")
    os.mkdir(data)
    half = TIER_RECORDS // 2
    pq.write_table(table.slice(0, half), os.path.join(data, "a.parquet"), row_group_size=TIER_ROW_GROUP)
    rows = table.slice(half).to_pylist()
    bad = invalid_rows(rows)
    with open(os.path.join(data, "b.jsonl"), "w") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in [*rows[: half // 2], *bad[:2], *rows[half // 2 :], bad[2]])
    return data


@pytest.fixture(scope="session")
def tier_local_outputs(tier_records, tmp_path_factory) -> tuple[str, str]:
    """`--runner local`'s bound and batch outputs of the tier's records: what every engine of the tier
    must write."""
    from madp.cli import main

    directory = tmp_path_factory.mktemp("tier-local")
    bound, batches = str(directory / "bound"), str(directory / "batches")
    assert main(["-q", "bound", tier_records, bound, *TIER_BOUND, "--runner", "local"]) == 0
    assert main(["-q", "batch", bound, tier_records, batches, *TIER_BATCH, "--runner", "local"]) == 0
    return bound, batches


def assert_same_rejects_and_report(output: str, expected: str) -> None:
    """The rejected rows of an engine's output and its report as the local run's (`expected`), but for
    what a report says of the run and its engine (`RUN_FACTS`)."""
    rejected = snapshot(os.path.join(expected, "rejected"))
    assert rejected, "the local run rejected no row: the input's invalid rows test nothing"
    assert snapshot(os.path.join(output, "rejected")) == rejected
    report, wanted = (json.load(open(os.path.join(path, "report.json"))) for path in (output, expected))
    assert report["rejected"] == wanted["rejected"] == {"duplicate_id": 2, "missing_id": 1, "non_scalar_user": 1}
    differing = sorted(key for key in report.keys() | wanted.keys() if report.get(key) != wanted.get(key))
    assert set(differing) <= set(RUN_FACTS), f"the reports differ in {differing}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    cluster = getattr(item, "funcargs", {}).get("spark_cluster")
    if report.failed and cluster is not None:
        report.sections.append(("Spark cluster logs", cluster.log_tails()))


@pytest.fixture(autouse=True)
def attempts_ledger(tmp_path_factory, monkeypatch):
    """Monte Carlo calibrations record themselves in a ledger: one per test, not the user's."""
    path = tmp_path_factory.mktemp("ledger") / "monte-carlo-attempts.jsonl"
    monkeypatch.setenv("MADP_ATTEMPTS_LEDGER", str(path))
    return path


def snapshot(directory) -> dict[str, bytes]:
    """Every file below a directory (by its path there) and its bytes."""
    return {
        os.path.relpath(os.path.join(root, name), directory): open(os.path.join(root, name), "rb").read()
        for root, _, files in os.walk(directory)
        for name in files
    }


def crash_at(monkeypatch, step: int) -> None:
    """Interrupt madp train (a KeyboardInterrupt) as it reports step `step` done."""
    from madp.training import trainer

    update = trainer.Progress.update

    def crash(self, done, *args):
        if done == step:
            raise KeyboardInterrupt
        update(self, done, *args)

    monkeypatch.setattr(trainer.Progress, "update", crash)


def reseal_selection(output) -> None:
    """After a test rewrites selection shards: list them in the report as if the bound had written them
    (a faulty engine with a consistent report), so that the verifier's recount is what is tested."""
    from madp.core.selection import selection_manifest

    path = os.path.join(output, "report.json")
    report = json.load(open(path))
    report["selection_files"] = selection_manifest(str(output), len(report["selection_files"]))
    with open(path, "w") as handle:
        json.dump(report, handle)


def reseal_batches(output) -> None:
    """After a test rewrites or removes batch files: list the files left in the batch report as if `madp
    batch` had written them (a faulty producer with a consistent report)."""
    from madp.core import storage

    path = os.path.join(output, "report.json")
    report = json.load(open(path))
    names = sorted(n for n in os.listdir(output) if n.startswith("batches-") and n.endswith(".tfrecord"))
    report["files"] = storage.manifest([os.path.join(output, name) for name in names])
    with open(path, "w") as handle:
        json.dump(report, handle)


def masked_crc(data: bytes) -> int:
    import google_crc32c

    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def rewrite_batches(output, edit, name: str = "batches-00000-of-00001.tfrecord", drop: int | None = None) -> None:
    """Apply `edit(number, example)` to every example of a batch file (but the one numbered `drop`, left
    out) and reseal the batch report."""
    from madp.core.verify.tfrecords import _example_class, read_tfrecord

    path = os.path.join(output, name)
    example_class = _example_class()
    framed = b""
    for number, payload in enumerate(read_tfrecord(path)):
        if number == drop:
            continue
        example = example_class.FromString(payload)
        edit(number, example)
        body = example.SerializeToString()
        header = struct.pack("<Q", len(body))
        framed += header + struct.pack("<I", masked_crc(header)) + body + struct.pack("<I", masked_crc(body))
    with open(path, "wb") as handle:
        handle.write(framed)
    reseal_batches(output)
