"""`madp bound --runner pyspark` against `--runner local`: the same selection files, byte for byte, the same
rejects and figures, whichever way the work is spread (splits, partitions, rounds on Spark or a local
finish). One SparkSession (local[2]) for the module: each bound runs in it, as in a caller's own session."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import graph_rows
from test_engines_agree import SAME_REPORT_FIELDS

from madp.cli import main
from madp.core.errors import InputError
from madp.core.selection import BoundOptions
from madp.engines.local_engine import run_local
from madp.spark.bound import run_spark
from madp.spark.session import TASK_FAILURE_LOGGERS, SparkOptions, spark_options, spark_session

pytestmark = [pytest.mark.spark]

BAD_ROWS = ['{"id": 5, "users": [1]}', '{"id": 9001, "users": []}', '{"users": [3]}', "not json", '{"id": 9002}']


@pytest.fixture(scope="module")
def spark():
    with spark_session(SparkOptions(master="local[2]", conf=("spark.ui.enabled=false",))) as session:
        yield session


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """A skewed graph of 3000 records: Parquet in row groups of 200, and JSON Lines with bad rows among
    its own (an id that the Parquet file holds too, empty users, no id, not JSON, no users)."""
    from madp.tools.data.synthetic import GraphSpec, generate

    data = generate(GraphSpec(records=3000, graph="skewed", records_per_user=3.0, seed=7))
    rows = graph_rows(data.offsets, data.users)
    directory = tmp_path_factory.mktemp("records")
    pq.write_table(pa.Table.from_pylist(rows[:1500]), directory / "part-0.parquet", row_group_size=200)
    lines = [json.dumps(row) for row in rows[1500:]]
    for at, bad in zip(range(100, 1500, 300), BAD_ROWS):
        lines.insert(at, bad)
    (directory / "part-1.jsonl").write_text("\n".join(lines) + "\n")
    return str(directory)


def outputs(output: str) -> dict[str, bytes]:
    """The selection and rejects files of a bound, by their path below OUTPUT; no work files left."""
    assert not os.path.exists(os.path.join(output, "_work"))
    found = {}
    for directory in ("selected", "rejected"):
        for name in (
            sorted(os.listdir(os.path.join(output, directory))) if os.path.isdir(f"{output}/{directory}") else []
        ):
            found[f"{directory}/{name}"] = open(os.path.join(output, directory, name), "rb").read()
    return found


def assert_same(tmp_path, input_path: str, options: BoundOptions, arguments: list[str]):
    local = run_local(input_path, str(tmp_path / "local"), options)
    spark = run_spark(input_path, str(tmp_path / "spark"), options, spark_options(arguments))
    for field in (*SAME_REPORT_FIELDS, "graph_digest"):
        assert getattr(local, field) == getattr(spark, field), field
    assert outputs(str(tmp_path / "local")) == outputs(str(tmp_path / "spark"))
    assert spark.engine == "pyspark" and spark.partitions == int(arguments[arguments.index("--partitions") + 1])
    return local, spark


def test_splits_of_both_formats_with_bad_rows_skipped_alike_rounds_then_a_local_finish(tmp_path, spark, records):
    options = BoundOptions(max_contributions=1, order="hash", seed=3, on_invalid="skip", output_shards=2)
    arguments = ["--partitions", "3", "--input-split-bytes", "8192", "--local-finish-incidences", "300"]
    local, spark_report = assert_same(tmp_path, records, options, [*arguments, "--spark-checkpoint-every", "1"])
    assert local.rejected == {
        "invalid_json": 1,
        "missing_id": 1,
        "empty_users": 1,
        "duplicate_id": 2,
        "missing_users": 1,
    }
    assert os.path.exists(tmp_path / "spark" / "rejected" / "rejected.jsonl")
    (run,) = spark_report.pipeline_runs
    assert len(run["iterations"]) > 1 and run["finished_locally_incidences"] > 0


def test_every_step_on_spark_with_duplicates_and_capacities(tmp_path, spark, records):
    capacities = tmp_path / "capacities.csv"
    capacities.write_text("user,capacity\n" + "".join(f"{u},{u % 3}\n" for u in range(0, 400, 2)))
    options = BoundOptions(max_contributions=3, duplicates=True, capacities=str(capacities), on_invalid="skip")
    arguments = ["--partitions", "2", "--local-finish-incidences", "0", "--spark-checkpoint-every", "2"]
    local, spark_report = assert_same(tmp_path, records, options, arguments)
    assert local.passes > 1 and spark_report.pipeline_runs[0]["finished_locally_incidences"] is None


def test_invalid_rows_stop_the_bound_with_the_local_engine_s_error(tmp_path, spark, records):
    options = BoundOptions(max_contributions=2)
    with pytest.raises(InputError) as local:
        run_local(records, str(tmp_path / "local"), options)
    output = tmp_path / "spark"
    with pytest.raises(InputError) as on_spark:
        run_spark(records, str(output), options, spark_options(["--partitions", "2"]))
    assert str(on_spark.value) == str(local.value).replace(str(tmp_path / "local"), str(output))
    assert not [path for path in output.rglob("*") if path.is_file() and path.name != ".madp-lock"]


def test_an_error_met_on_an_executor_is_the_one_line_the_local_engine_prints(tmp_path, spark):
    (tmp_path / "input").mkdir()
    (tmp_path / "input" / "a.jsonl").write_text('{"id": 1, "users": [1]}\n')  # the driver reads this one's first rows
    (tmp_path / "input" / "broken.parquet").write_bytes(b"not a parquet file at all")  # an executor plans this one
    with pytest.raises(InputError) as local:
        run_local(str(tmp_path / "input"), str(tmp_path / "local"), BoundOptions(max_contributions=1))
    with pytest.raises(InputError) as on_spark:
        run_spark(str(tmp_path / "input"), str(tmp_path / "spark"), BoundOptions(max_contributions=1), SparkOptions())
    assert "broken.parquet: not a readable Parquet file" in str(on_spark.value) and "\n" not in str(on_spark.value)
    assert str(local.value).split(" (")[0] == str(on_spark.value).split(" (")[0]


def test_no_failed_task_s_trace_is_logged_while_madp_runs_in_a_caller_s_session(spark):
    """Spark's executor and task set log a failed task's whole Python and Java stack trace (a local master's
    executor on the console): madp's one-line error would come after it. Off while madp's job runs in the
    caller's session, at the caller's levels again after it."""
    log4j = spark.sparkContext._jvm.org.apache.logging.log4j

    def levels() -> list[str]:
        return [str(log4j.LogManager.getLogger(name).getLevel()) for name in TASK_FAILURE_LOGGERS]

    for name in TASK_FAILURE_LOGGERS:  # as a caller's session logs them
        log4j.core.config.Configurator.setLevel(name, log4j.Level.WARN)
    with spark_session(SparkOptions()) as session:
        assert session is spark and levels() == ["OFF", "OFF"]
    assert levels() == ["WARN", "WARN"]


def test_the_jvm_of_a_session_madp_built_compiles_at_the_jit_s_first_tier_only(spark):
    """madp's default (`spark.driver.extraJavaOptions`) reached the JVM it started: its own arguments say so."""
    runtime = spark.sparkContext._jvm.java.lang.management.ManagementFactory.getRuntimeMXBean()
    assert "-XX:TieredStopAtLevel=1" in list(runtime.getInputArguments())


def test_without_partitions_a_small_input_takes_two_per_core_and_groups_without_spilling(tmp_path, spark, records):
    """madp's defaults reached the session and the job: two partitions per core of local[2], and the Python
    workers' spill threshold at 2 GB."""
    options = BoundOptions(max_contributions=2, on_invalid="skip")
    report = run_spark(records, str(tmp_path / "spark"), options, SparkOptions())
    assert spark.sparkContext.defaultParallelism == 2 and report.partitions == 4
    assert spark.sparkContext.getConf().get("spark.python.worker.memory") == "2g"


def test_the_command_line(tmp_path, spark, records, capsys, monkeypatch):
    """Paths relative to the folder the command runs in, which is not the executors' (theirs is the one the
    session started in, on a cluster one of their own)."""
    output = str(tmp_path / "out")
    monkeypatch.chdir(tmp_path)
    argv = ["bound", os.path.relpath(records), "out", "-k", "2", "--on-invalid", "skip", "--runner", "pyspark"]
    assert main([*argv, "--spark-master", "local[2]", "--partitions", "2"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["engine"] == "pyspark" and printed["selected_records"] > 0
    run_local(records, str(tmp_path / "local"), BoundOptions(max_contributions=2, on_invalid="skip"))
    assert outputs(output) == outputs(str(tmp_path / "local"))
    assert main([*argv, "--spark-conf", "no-equals-sign"]) == 2
    assert "a Spark property is KEY=VALUE" in capsys.readouterr().err
