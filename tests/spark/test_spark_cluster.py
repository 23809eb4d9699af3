"""The Spark standalone cluster of the runner tier (a master and two one-core workers the session starts
from the installed pyspark, conftest.spark_cluster) runs PySpark jobs across both workers, and a job
survives an executor JVM killed under it (runner_services.executor_killed): the result is right, and
the driver sees the lost executor and the failed task, where madp's Spark engine can read them:

- the driver's status REST API, at `{sc.uiWebUrl}/api/v1/applications/{sc.applicationId}`:
  `/allexecutors` lists every executor, a lost one with `isActive` false and its `removeReason`
  ("Command exited with code 137"), and `/stages` each stage attempt's `numFailedTasks`;
- `sc.statusTracker()` (no UI needed): the jobs of a job group, their stages, and each stage's
  `numFailedTasks` (its latest attempt's).

And madp on the cluster (`--runner pyspark --spark-master spark://...`), on the Prism tier's records
(conftest.tier_records): `madp bound` and `madp batch`, an executor killed under each while a task runs
on it, write exactly the files `--runner local` writes (selection shards, batch files, schema.json,
rejected rows), byte for byte, with the same reject counts, and report the loss (a warning line,
`spark_faults` in report.json); a `madp run` config runs both stages on the cluster, each in a session
madp builds, the batching's with speculative task copies, and writes the local run's files. One
SparkSession serves the module but the first test, which needs none active (a session costs 10-20 s).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

import pytest
import runner_services
import yaml
from conftest import (
    TIER_BATCH,
    TIER_BOUND,
    TIER_SPLITS,
    assert_same_rejects_and_report,
    snapshot,
)
from test_runner_tier import deadline

from madp.cli import main
from madp.tools.spark_standalone import loopback_json

pytestmark = [pytest.mark.spark, pytest.mark.slow]

JOB_SECONDS = 180  # a hung job fails its test instead of holding the tier


def test_a_run_config_on_the_cluster_with_speculation_writes_the_local_files(spark_cluster, tmp_path, capsys):
    """A `madp run` config whose stages run on the cluster (`runner: pyspark`), each in the session madp
    builds on `--spark-master` (before this module's own session: madp would run in that one), the
    batching's with speculative task copies, which Spark starts eagerly here: the bound's and batches'
    files are the local run's, though a copy ran beside some task."""
    from pyspark.sql import SparkSession

    assert SparkSession.getActiveSession() is None, "a session is active: madp would not build its own"
    spark = ["--spark-master", spark_cluster.master_url, "--partitions", "2", "--input-split-bytes", "20000"]
    speculative = ["spark.speculation=true", "spark.speculation.quantile=0.5", "spark.speculation.multiplier=1"]
    speculative.append("spark.speculation.minTaskRuntime=0ms")  # not only tasks over 100 ms: few are, here
    outputs = {}
    for runner, bound_options, batch_options in (
        ("local", [], []),
        ("pyspark", spark, [*spark, *(argument for setting in speculative for argument in ("--spark-conf", setting))]),
    ):
        config = {
            "run_dir": str(tmp_path / runner),
            "generate": {"records": 2000, "features": 3, "seed": 4},
            "bound": {"max_contributions": 2, "runner": runner, "runner_options": bound_options},
            "batch": {"steps": 8, "batch_size": 60, "min_sep": 2, "seed": 1, "runner": runner}
            | {"runner_options": batch_options},
        }
        path = tmp_path / f"{runner}.yaml"
        path.write_text(yaml.safe_dump(config))
        with deadline(JOB_SECONDS, f"madp run with runner {runner}"):
            assert main(["-q", "run", str(path)]) == 0
        stages = {stage["stage"]: stage["status"] for stage in json.loads(capsys.readouterr().out)["stages"]}
        assert stages["bound"] == stages["batch"] == stages["verify-batches"] == "ran", stages
        outputs[runner] = {
            os.path.join(stage, name): content
            for stage in ("bound", "batches")
            for name, content in snapshot(str(tmp_path / runner / stage)).items()
            if name != "report.json"
        }
    assert sorted(outputs["pyspark"]) == sorted(outputs["local"])
    assert [name for name in outputs["local"] if outputs["pyspark"][name] != outputs["local"][name]] == []
    report = json.load(open(tmp_path / "pyspark" / "batches" / "report.json"))
    assert report["engine"] == "pyspark" and report["spark_faults"] == {"executors_lost": 0, "tasks_retried": 0}
    assert [app["name"] for app in spark_cluster.state()["completedapps"]] == ["madp", "madp"]  # bound, batch
    assert "reason: another attempt succeeded" in executor_logs(spark_cluster), "no speculative copy ran"


def executor_logs(cluster) -> str:
    """What the cluster's executors have logged so far (their stderr)."""
    return "".join(
        open(os.path.join(root, "stderr"), errors="replace").read()
        for root, _, names in os.walk(cluster.directory)
        if "stderr" in names
    )


@pytest.fixture(scope="module")
def spark(spark_master):
    """A SparkSession on the cluster, its executors running this interpreter, the driver on loopback.
    It waits for both executors before the first job, so that both take part in it."""
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master(spark_master)
        .appName("madp-runner-tier")
        .config("spark.pyspark.python", sys.executable)
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.executor.memory", "1g")
        .config("spark.scheduler.minRegisteredResourcesRatio", "1.0")
        .config("spark.scheduler.maxRegisteredResourcesWaitingTime", f"{JOB_SECONDS}s")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    assert session.sparkContext.master == spark_master, "another SparkSession of this process was taken"
    yield session
    session.stop()


def status(spark, path: str):
    """An answer of the driver's status REST API for this application."""
    context = spark.sparkContext
    return loopback_json(f"{context.uiWebUrl}/api/v1/applications/{context.applicationId}/{path}")


def executor_rows(spark) -> list[dict]:
    return [row for row in status(spark, "allexecutors") if row["id"] != "driver"]


def slowly_keyed(value: int) -> tuple[int, int]:
    time.sleep(0.25)  # a task of a few of these runs long enough for both executors, and for a kill
    return value % 7, value


def test_a_grouped_job_runs_on_both_workers(spark, spark_cluster):
    assert spark_cluster.state()["aliveworkers"] == 2
    grouped = spark.sparkContext.parallelize(range(64), 8).map(slowly_keyed).groupByKey().mapValues(sum).collect()
    assert dict(grouped) == {key: sum(range(key, 64, 7)) for key in range(7)}
    executors = executor_rows(spark)
    assert len(executors) == 2 and all(row["completedTasks"] > 0 for row in executors), executors
    # an executor takes all of its worker's one core: the application's two cores are on both workers
    assert [app["cores"] for app in spark_cluster.state()["activeapps"]] == [2]


def test_a_job_survives_a_lost_executor_and_the_driver_sees_it(spark, spark_cluster):
    context = spark.sparkContext
    context.setJobGroup("executor-loss", "a job whose executor is killed")
    with runner_services.executor_killed(spark_cluster, after_seconds=1.0) as kill:
        grouped = context.parallelize(range(96), 12).map(slowly_keyed).groupByKey().mapValues(sum).collect()
    assert dict(grouped) == {key: sum(range(key, 96, 7)) for key in range(7)}
    assert kill.pid not in spark_cluster.executors(), "the killed executor still runs"

    lost = [row["removeReason"] for row in executor_rows(spark) if not row["isActive"]]
    assert len(lost) == 1 and "exited with code 137" in lost[0], executor_rows(spark)  # 128 + SIGKILL
    assert sum(stage["numFailedTasks"] for stage in status(spark, "stages")) >= 1

    tracker = context.statusTracker()
    stages = [stage for job in tracker.getJobIdsForGroup("executor-loss") for stage in tracker.getJobInfo(job).stageIds]
    assert sum(tracker.getStageInfo(stage).numFailedTasks for stage in stages) >= 1


# --- madp on the cluster: the same files as --runner local, an executor lost ----------------------------


def on_cluster(args: list[str], spark_master: str) -> None:
    """`madp -q ARGS --runner pyspark --spark-master SPARK_MASTER` through the CLI, within a deadline."""
    with deadline(JOB_SECONDS, f"madp {args[0]} on the Spark cluster"):
        assert main(["-q", *args, "--runner", "pyspark", "--spark-master", spark_master, *TIER_SPLITS]) == 0


def assert_local_output(output: str, expected: str) -> None:
    """OUTPUT holds exactly the files the local run wrote, byte for byte but the report, which differs
    only in what it says of the engine and the run."""
    written, wanted = snapshot(output), snapshot(expected)
    assert sorted(written) == sorted(wanted)
    assert [name for name in wanted if name != "report.json" and written[name] != wanted[name]] == []
    assert_same_rejects_and_report(output, expected)


def assert_loss_reported(output: str, command: str, caplog) -> None:
    """The report and the one warning line say that one executor was lost and tasks were retried."""
    faults = json.load(open(os.path.join(output, "report.json")))["spark_faults"]
    assert faults["executors_lost"] == 1 and faults["tasks_retried"] >= 1, faults
    (warning,) = [record.getMessage() for record in caplog.records if record.name == "madp.spark"]
    said = rf"Spark lost 1 executor\(s\) during madp {command} \(executor \d+: Command exited with code 137\); "
    assert re.fullmatch(said + f"{faults['tasks_retried']} task\\(s\\) failed and were retried", warning), warning


def test_bound_on_the_cluster_writes_the_local_files_though_an_executor_is_lost(
    spark, spark_cluster, tier_records, tier_local_outputs, tmp_path, caplog
):
    bound, _ = tier_local_outputs
    output = str(tmp_path / "bound")
    with runner_services.executor_killed(spark_cluster, after_seconds=3.0, mid_task=True):
        on_cluster(["bound", tier_records, output, *TIER_BOUND], spark_cluster.master_url)
    assert_local_output(output, bound)
    assert_loss_reported(output, "bound", caplog)


def test_batch_on_the_cluster_writes_the_local_files_though_an_executor_is_lost(
    spark, spark_cluster, tier_records, tier_local_outputs, tmp_path, caplog
):
    bound, batches = tier_local_outputs
    output = str(tmp_path / "batches")
    with runner_services.executor_killed(spark_cluster, after_seconds=3.0, mid_task=True):
        on_cluster(["batch", bound, tier_records, output, *TIER_BATCH], spark_cluster.master_url)
    assert_local_output(output, batches)
    assert_loss_reported(output, "batch", caplog)
