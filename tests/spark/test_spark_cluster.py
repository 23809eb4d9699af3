"""The Spark standalone cluster of the runner tier (a master and two one-core workers the session starts
from the installed pyspark, conftest.spark_cluster) runs PySpark jobs across both workers, and a job
survives an executor JVM killed under it (runner_services.executor_killed): the result is right, and
the driver sees the lost executor and the failed task, where madp's Spark engine can read them:

- the driver's status REST API, at `{sc.uiWebUrl}/api/v1/applications/{sc.applicationId}`:
  `/allexecutors` lists every executor, a lost one with `isActive` false and its `removeReason`
  ("Command exited with code 137"), and `/stages` each stage attempt's `numFailedTasks`;
- `sc.statusTracker()` (no UI needed): the jobs of a job group, their stages, and each stage's
  `numFailedTasks` (its latest attempt's).
"""

from __future__ import annotations

import sys
import time

import pytest
import runner_services

from madp.tools.spark_standalone import loopback_json

pytestmark = [pytest.mark.spark, pytest.mark.slow]

JOB_SECONDS = 180  # a hung job fails its test instead of holding the tier


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
