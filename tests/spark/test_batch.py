"""`madp batch --runner pyspark`: the batch files, schema.json and rejects byte for byte those of
`--runner local`, the input (Parquet of several row groups, JSON Lines with bad rows) read in several
splits; a run without --seed, whose key no Spark setting holds; the CLI; and a `madp run` config that
bounds and batches on Spark."""

from __future__ import annotations

import json
import os
import shutil

import pyarrow.parquet as pq
import pytest
import yaml

from madp.cli import main
from madp.core.errors import InputError
from madp.core.randomness import SECRET
from madp.engines.batching import BatchOptions
from madp.tools.data.synthetic import GraphSpec, generate, to_table

pytest.importorskip("pyspark")
pytestmark = pytest.mark.spark

RECORDS = 3000
BATCH = ["--steps", "20", "--batch-size", "60", "--min-sep", "3", "--max-batch-size", "90", "--output-shards", "2"]
SKIP = ["--on-invalid", "skip"]
SPARK = ["--runner", "pyspark", "--partitions", "3", "--input-split-bytes", "40000"]
BAD_ROWS = [
    "not json at all\n",
    json.dumps({"id": 90001}) + "\n",  # no users
    json.dumps({"id": 7, "users": [5], "features": [0.0] * 4, "label": 1}) + "\n",  # the id of a Parquet record
    # a record of its own user (so bounded in), whose content the batching rejects under skip
    json.dumps({"id": 90002, "users": [777777], "features": [None, 1.0, 2.0, 3.0], "label": 0}) + "\n",
]


@pytest.fixture(scope="module")
def spark():
    """One local[2] SparkSession for the module, built as madp builds one (executors on this Python),
    stopped at the end; madp's runs use it, the active session."""
    from madp.spark.session import spark_options, spark_session

    with spark_session(
        spark_options(["--spark-master", "local[2]", "--spark-conf", "spark.ui.enabled=false"])
    ) as session:
        yield session


def madp(*args: str) -> None:
    assert main(["-q", *args]) == 0


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """Skewed records (Parquet in row groups, JSON Lines with bad rows), bounded locally, and the local
    engine's batches of them: what Spark must write."""
    directory = tmp_path_factory.mktemp("local")
    data = str(directory / "records")
    os.mkdir(data)
    table = to_table(generate(GraphSpec(records=RECORDS, features=4, seed=13)))
    half = RECORDS // 2
    pq.write_table(table.slice(0, half), os.path.join(data, "a.parquet"), row_group_size=half // 6)
    with open(os.path.join(data, "b.jsonl"), "w") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in table.slice(half).to_pylist())
        handle.writelines(BAD_ROWS)
    bound, batches = str(directory / "bound"), str(directory / "batches")
    madp("bound", data, bound, "-k", "2", *SKIP, "--runner", "local")
    madp("batch", bound, data, batches, *BATCH, *SKIP, "--seed", "5", "--runner", "local")
    return data, bound, batches


def contents(directory: str) -> dict[str, bytes]:
    """The files of a batch output that Spark must write as the local engine does, by name."""
    found = {}
    for root, _, names in os.walk(directory):
        for name in names:
            relative = os.path.relpath(os.path.join(root, name), directory)
            if name.endswith(".tfrecord") or name in ("schema.json", "rejected.jsonl"):
                found[relative] = open(os.path.join(root, name), "rb").read()
    return found


def assert_local_files(output: str, expected: str) -> None:
    written, wanted = contents(output), contents(expected)
    assert "rejected/rejected.jsonl" in wanted and len(wanted) == 4
    assert sorted(written) == sorted(wanted)
    assert [name for name in wanted if written[name] != wanted[name]] == []
    assert sorted(os.listdir(output)) == sorted(os.listdir(expected)), "OUTPUT holds what a local run writes"


def test_batch_files_schema_and_rejects_are_the_local_ones(spark, local, tmp_path):
    data, bound, batches = local
    output = str(tmp_path / "batches")
    madp("batch", bound, data, output, *BATCH, *SKIP, "--seed", "5", *SPARK)
    assert_local_files(output, batches)
    report, expected = (json.load(open(os.path.join(d, "report.json"))) for d in (output, batches))
    assert report["engine"] == "pyspark" and report["partitions"] == 3
    for key in ("sampling_probability", "records", "units", "batch_sizes", "written_batch_sizes", "participation"):
        assert report[key] == expected[key], key
    assert report["rejected"] == expected["rejected"] and report["rejected_total"] >= 4


def test_files_written_in_pieces_by_tasks_of_their_own_are_the_local_ones(spark, local, tmp_path):
    from madp.spark.batch import ROWS_PER_PIECE, file_pieces, piece_runs

    assert piece_runs(1000 * 1000, partitions=4) == -(-1000 * 1000 // ROWS_PER_PIECE)  # bounded by the rows
    assert piece_runs(20 * 30.5, partitions=7) == 7  # one per partition at least

    assert file_pieces(2, 20, 7) == [(0, range(0, 3)), (0, range(3, 6)), (0, range(6, 10))] + [
        (1, range(10, 13)),
        (1, range(13, 16)),
        (1, range(16, 20)),
    ]
    data, bound, batches = local
    output = str(tmp_path / "batches")
    madp("batch", bound, data, output, *BATCH, *SKIP, "--seed", "5", "--runner", "pyspark", "--partitions", "7")
    assert_local_files(output, batches)
    report, expected = (json.load(open(os.path.join(d, "report.json"))) for d in (output, batches))
    for key in ("written_batch_sizes", "truncated_rows", "padding_rows", "records_never_written", "participation"):
        assert report[key] == expected[key], key
    assert report["files"] == expected["files"]  # names, sizes and SHA-256


def test_without_a_seed_the_run_works_and_no_spark_setting_holds_the_key(spark, local, tmp_path, caplog):
    from madp.spark.batch import run_spark
    from madp.spark.session import spark_options

    data, bound, _ = local
    output = str(tmp_path / "batches")
    options = BatchOptions(steps=20, batch_size=60, min_sep=3, on_invalid="skip")
    report = run_spark(bound, data, output, options, spark_options(["--partitions", "2"]))
    assert report.sampling == SECRET and report.parameters.seed is None
    words = [str(word) for word in options.key.words] + [f"{word:x}" for word in options.key.words]
    settings = " ".join(f"{key}={value}" for key, value in spark.sparkContext.getConf().getAll())
    assert not [word for word in words if word in settings]
    assert not [word for word in words if word in caplog.text]
    assert not os.path.exists(os.path.join(output, "_work"))


def test_the_cli_on_a_spark_master_replaces_earlier_batches(spark, local, tmp_path, capsys):
    data, bound, batches = local
    output = str(tmp_path / "batches")
    shutil.copytree(batches, output)
    open(os.path.join(output, "batches-00000-of-00003.tfrecord"), "wb").close()  # of an earlier run
    args = ["batch", bound, data, output, *BATCH, *SKIP, "--seed", "5", "--runner", "pyspark"]
    assert main([*args, "--spark-master", "local[2]", "--partitions", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["engine"] == "pyspark"
    assert_local_files(output, batches)


def test_a_run_config_bounds_and_batches_on_spark(spark, tmp_path, capsys):
    config = {
        "run_dir": str(tmp_path / "run"),
        "generate": {"records": 600, "features": 3, "seed": 4},
        "bound": {"max_contributions": 2, "runner": "pyspark", "runner_options": ["--partitions", "2"]},
        "batch": {
            "steps": 8,
            "batch_size": 20,
            "min_sep": 2,
            "seed": 1,
            "runner": "pyspark",
            "runner_options": ["--partitions", "2"],
        },
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["-q", "run", str(path)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert {stage["stage"]: stage["status"] for stage in summary["stages"]}["verify-batches"] == "ran"
    for stage in ("bound", "batches"):
        assert json.load(open(tmp_path / "run" / stage / "report.json"))["engine"] == "pyspark"


def test_the_bounding_s_own_spark_options_are_refused(tmp_path):
    from madp.spark.batch import run_spark
    from madp.spark.session import spark_options

    options = BatchOptions(steps=2, batch_size=1)
    with pytest.raises(InputError, match="--spark-checkpoint-every: options of madp bound, not of madp batch"):
        run_spark("bound", "data", str(tmp_path / "out"), options, spark_options(["--spark-checkpoint-every", "3"]))
