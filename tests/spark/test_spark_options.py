"""`--runner pyspark`'s options and the checks made before Spark starts: no SparkSession here."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from typing import NamedTuple

import pytest
from conftest import ROOT

from madp.core import partitioning
from madp.core.errors import InputError
from madp.core.reports import SparkFaults
from madp.spark import session
from madp.spark.session import SparkOptions, spark_options, spark_session


def test_trailing_arguments_are_the_spark_options():
    parsed = spark_options(
        ["--spark-master", "local[2]", "--spark-conf", "spark.executor.memory=2g", "--spark-conf", "a.b=c=d"]
        + ["--partitions", "4", "--input_split_bytes", "2048", "--spark-checkpoint-every", "3"]
    )
    assert parsed == SparkOptions(
        partitions=4,
        input_split_bytes=2048,
        master="local[2]",
        conf=("spark.executor.memory=2g", "a.b=c=d"),
        checkpoint_every=3,
    )
    assert parsed.settings == {"spark.executor.memory": "2g", "a.b": "c=d"}
    assert spark_options([]) == SparkOptions()


@pytest.mark.parametrize(
    "arguments, said",
    [
        (["--spark-conf", "spark.executor.memory"], "a Spark property is KEY=VALUE"),
        (["--min_sep", "2"], "unrecognized option(s) --min_sep 2: not an option of --runner pyspark"),
        (["--partitions"], "--partitions: expected one argument"),
        (["--partitions", "0"], "--partitions must be at least 1"),
        (["--input-split-bytes", "10"], "--input-split-bytes must be at least 1024"),
        (["--spark-checkpoint-every", "0"], "--spark-checkpoint-every must be at least 1"),
    ],
)
def test_a_wrong_option_is_one_error_naming_it(arguments, said):
    with pytest.raises(InputError) as raised:
        spark_options(arguments)
    assert said in str(raised.value) and "\n" not in str(raised.value)


def test_without_partitions_a_job_takes_one_per_share_of_its_input_rows_and_two_per_core():
    least = partitioning.TASKS_PER_CORE
    for per in (partitioning.BOUND_RECORDS_PER_PARTITION, partitioning.BATCH_RECORDS_PER_PARTITION):
        assert SparkOptions().partitions_for(1_000, 2, per) == 2 * least  # a small input: every core busy
        assert SparkOptions().partitions_for(1_000, 50, per) == 50 * least
        assert SparkOptions().partitions_for(40 * per, 2, per) == 40
        assert SparkOptions().partitions_for(40 * per + 1, 2, per) == 41  # no partition holds more than its share
        assert SparkOptions(partitions=4).partitions_for(40 * per, 2, per) == 4  # --partitions decides where given
    assert SparkOptions().partitions_for(None) == partitioning.DEFAULT_PARTITIONS  # Beam's: input unread


def test_a_python_caller_s_wrong_property_is_refused():
    with pytest.raises(InputError, match="--spark-conf: a Spark property is KEY=VALUE"):
        SparkOptions(conf=("no equals sign",))


def test_madp_runs_its_executors_on_this_python_unless_told(monkeypatch):
    monkeypatch.delenv("PYSPARK_PYTHON", raising=False)
    monkeypatch.delenv("PYSPARK_DRIVER_PYTHON", raising=False)
    settings = session.session_settings(SparkOptions(conf=("spark.pyspark.python=./env/bin/python",)))
    assert settings["spark.pyspark.python"] == "./env/bin/python"
    assert settings["spark.pyspark.driver.python"] == sys.executable


@pytest.mark.parametrize(
    "key, madps, users",
    [
        ("spark.python.daemon.module", "madp.spark.daemon", "pyspark.daemon"),  # workers forked with madp imported
        ("spark.python.worker.memory", "2g", "512m"),  # the workers' groupings spill above 2 GB
    ],
)
def test_a_default_of_madp_s_holds_unless_told(key, madps, users):
    assert session.session_settings(SparkOptions())[key] == madps
    assert session.session_settings(SparkOptions(conf=(f"{key}={users}",)))[key] == users


def test_madp_s_jvms_compile_at_the_jit_s_first_tier_unless_told():
    settings = session.session_settings(SparkOptions())
    assert settings["spark.driver.extraJavaOptions"] == settings["spark.executor.extraJavaOptions"] == session.C1_ONLY
    told = session.session_settings(SparkOptions(conf=("spark.executor.extraJavaOptions=-Dx=1",)))
    assert told["spark.executor.extraJavaOptions"] == "-Dx=1"
    assert told["spark.driver.extraJavaOptions"] == session.C1_ONLY


def test_workers_forked_from_madp_s_python_daemon_use_numpy_and_pyarrow():
    """PySpark's daemon forks a Python worker per task, and a forked child has only the thread that forked
    it: the threads that `madp.spark.daemon`'s imports start (OpenBLAS's, jemalloc's) are re-made in
    children that multiply matrices and allocate and compute Arrow arrays, several at once."""
    code = """
import os, sys
import madp.spark.daemon
import numpy as np, pyarrow as pa, pyarrow.compute as pc
assert "pandas" not in sys.modules

def work():
    matrix = np.random.default_rng(1).random((200, 200))
    table = pa.table({"x": pa.array(np.arange(1_000_000)), "y": pa.array(np.arange(1_000_000) % 7)})
    grouped = table.group_by("y").aggregate([("x", "sum")])
    return (matrix @ matrix).sum() > 0 and pc.sum(table["x"]).as_py() > 0 and grouped.num_rows == 7

children = []
for _ in range(4):
    child = os.fork()
    if child == 0:
        os._exit(0 if all(work() for _ in range(3)) else 3)
    children.append(child)
print(len(os.listdir("/proc/self/task")), [os.waitpid(child, 0)[1] for child in children])
"""
    env = {**os.environ, "PYTHONPATH": ROOT}
    said = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True, timeout=120
    )
    threads, statuses = said.stdout.split(" ", 1)
    assert int(threads) > 1  # the daemon forks from several threads: the test is of something
    assert statuses.strip() == "[0, 0, 0, 0]"


def test_missing_or_old_java_is_one_error_naming_java_17(monkeypatch, tmp_path):
    monkeypatch.delenv("JAVA_HOME", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(InputError, match=r"^--runner pyspark needs Java 17 or newer: no java found"):
        session.check_java()
    old = tmp_path / "java"
    old.write_text("#!/bin/sh\necho 'openjdk version \"11.0.2\" 2019-01-15' >&2\n")
    old.chmod(0o755)
    with pytest.raises(InputError, match=r'needs Java 17 or newer: .*java is openjdk version "11.0.2"'):
        session.check_java()


def test_madp_spark_imports_no_apache_beam():
    code = (
        "import importlib, pkgutil, sys, madp.spark\n"
        "for module in pkgutil.iter_modules(madp.spark.__path__, 'madp.spark.'):\n"
        "    importlib.import_module(module.name)\n"
        "print('apache_beam' in sys.modules)"
    )
    env = {**os.environ, "PYTHONPATH": ROOT}
    said = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert said.stdout.strip() == "False"


@pytest.mark.spark
def test_a_session_madp_built_leaves_its_settings_to_no_later_session():
    """Spark's JVM keeps the first context's settings as system properties, the defaults of every later
    session in the process: a session madp built and stopped takes its settings with it."""
    from pyspark.sql import SparkSession

    assert SparkSession.getActiveSession() is None  # else madp runs in it, as in a caller's
    with spark_session(SparkOptions(master="local[1]", conf=("spark.madp.test=1", "spark.ui.enabled=false"))):
        pass
    later = SparkSession.builder.master("local[1]").appName("later").getOrCreate()
    try:
        assert later.sparkContext.getConf().get("spark.madp.test") is None
        assert later.sparkContext.uiWebUrl is not None  # the UI madp turned off is on again
    finally:
        later.stop()


class _Context(NamedTuple):
    """What a fault watch reads of a SparkContext."""

    uiWebUrl: str | None
    applicationId: str = "app-1"

    def addJobTag(self, tag: str) -> None:
        pass

    def removeJobTag(self, tag: str) -> None:
        pass


def test_with_the_spark_ui_off_or_unanswering_executor_losses_are_unknown_not_zero(caplog):
    from madp.spark.faults import UNKNOWN, fault_watch

    caplog.set_level(logging.INFO, "madp.spark")
    assert UNKNOWN == SparkFaults(executors_lost=None, tasks_retried=None)
    with fault_watch(_Context(None), "madp bound") as watch:
        assert watch.faults() == UNKNOWN
    assert "madp bound: the Spark UI is off: executors lost and tasks retried unknown" in caplog.text
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        with fault_watch(_Context(f"http://127.0.0.1:{closed.getsockname()[1]}"), "madp batch") as watch:
            assert watch.faults() == UNKNOWN
    assert "madp batch: the Spark UI's status API gave no answer" in caplog.text
    report = {"executors_lost": None, "tasks_retried": None}
    assert SparkFaults.from_json(report) == UNKNOWN and UNKNOWN.to_json() == report
