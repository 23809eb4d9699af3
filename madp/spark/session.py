"""The options of `--runner pyspark`, declared once (`madp.core.options.option`) and parsed from a
command's trailing arguments, and the SparkSession a job runs in: the caller's own active session, or
one madp builds from the options (and stops at the end)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, NoReturn

from madp.core.errors import InputError
from madp.core.options import add_options, declared, option, options_from
from madp.core.partitioning import PartitionOptions

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

RUNNER = "pyspark"  # the runner name of madp's Spark engine (not Beam's SparkRunner)
MIN_JAVA = 17
PYTHON_SETTINGS = (("spark.pyspark.python", "PYSPARK_PYTHON"), ("spark.pyspark.driver.python", "PYSPARK_DRIVER_PYTHON"))
# madp's defaults for a session it builds, where the user sets none: no progress bars between madp's lines
# on stderr; Python workers forked with madp's modules imported (`madp.spark.daemon`); the JVMs' JIT
# compiling at its first tier only: madp's JVMs move bytes they never decode, and the optimizing tier's
# compiling cost a third of their CPU time (10M records: JVM CPU 98 -> 67 s, bound 115 -> 98 s); and the
# Python workers' groupings spilling to disk above 2 GB of resident memory, not PySpark's 512 MB: a
# madp grouping holds a partition's few large elements, which a spill only writes out and reads back
# (10M records in 20 partitions: the batching spilled 629 MB and took 78 s instead of 59)
C1_ONLY = "-XX:TieredStopAtLevel=1"
DEFAULT_SETTINGS = {
    "spark.ui.showConsoleProgress": "false",
    "spark.python.daemon.module": "madp.spark.daemon",
    "spark.driver.extraJavaOptions": C1_ONLY,
    "spark.executor.extraJavaOptions": C1_ONLY,
    "spark.python.worker.memory": "2g",
}
# The loggers that print a failed task's whole Python and Java stack trace (the executor's, which a local
# master shows on the console, and the driver's task set's): madp reports what failed itself, an InputError
# as its one line, lost executors and retried tasks as a warning (`faults.fault_watch`), and any other
# failure is raised with Spark's trace in it.
TASK_FAILURE_LOGGERS = ("org.apache.spark.executor.Executor", "org.apache.spark.scheduler.TaskSetManager")


def conf_setting(text: str) -> str:
    """A `--spark-conf` value: KEY=VALUE, KEY a Spark property (no spaces)."""
    key, equals, _ = text.partition("=")
    if not equals or not re.fullmatch(r"[A-Za-z0-9_.\-]+", key):
        raise argparse.ArgumentTypeError(f"a Spark property is KEY=VALUE (e.g. spark.executor.memory=4g), got {text!r}")
    return text


@dataclasses.dataclass(frozen=True)
class SparkOptions(PartitionOptions):
    """The options of `--runner pyspark` (each field its `--flag`), beside those every partitioned engine
    takes (`PartitionOptions`: --partitions, --input-split-bytes, --local-finish-incidences, as on Beam):
    the Spark master, Spark properties, and the reliable checkpoints that bound a long bounding's lineage."""

    master: str = option(
        "local[*]",
        flag="--spark-master",
        help="madp on Spark: the master URL (local[N], spark://HOST:PORT, yarn, k8s://...); ignored where the "
        "caller's own SparkSession is active",
    )
    conf: tuple[str, ...] = option(
        (),
        flag="--spark-conf",
        repeatable=True,
        parse=conf_setting,
        metavar="KEY=VALUE",
        help="madp on Spark: a Spark property of the session madp builds (repeatable), e.g. "
        "spark.executor.memory=4g or spark.archives=env.tar.gz#env",
    )
    checkpoint_dir: str | None = option(
        None,
        flag="--spark-checkpoint-dir",
        help="madp on Spark: where the bounding's rounds are checkpointed, a folder every executor and the "
        "driver reach (default: OUTPUT/_work/checkpoints, removed at the end)",
    )
    checkpoint_every: int = option(
        5,
        flag="--spark-checkpoint-every",
        help="madp on Spark: rounds of the bounding between reliable checkpoints of its state",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        for setting in self.conf:
            try:
                conf_setting(setting)
            except argparse.ArgumentTypeError as error:
                raise InputError(f"--spark-conf: {error}") from None
        if self.checkpoint_every < 1:
            raise InputError("--spark-checkpoint-every must be at least 1")

    @property
    def settings(self) -> dict[str, str]:
        """The `--spark-conf` properties, by key (a later one wins)."""
        return dict(setting.split("=", 1) for setting in self.conf)  # type: ignore[misc]


class _OptionsParser(argparse.ArgumentParser):
    """Its errors are InputErrors (the command's one-line message), not an exit."""

    def error(self, message: str) -> NoReturn:
        raise InputError(f"--runner {RUNNER}: {message}")


def spark_options(arguments: Sequence[str]) -> SparkOptions:
    """The `SparkOptions` of a command's trailing arguments; one that is none of them is an error naming it."""
    parser = _OptionsParser(prog=f"--runner {RUNNER}", allow_abbrev=False, add_help=False, exit_on_error=False)
    add_options(parser, SparkOptions)
    try:
        parsed, unknown = parser.parse_known_args(list(arguments))
    except argparse.ArgumentError as error:
        raise InputError(f"--runner {RUNNER}: {error}") from None
    if unknown:
        known = ", ".join(each.flags[0] for each in declared(SparkOptions))
        raise InputError(
            f"unrecognized option(s) {' '.join(unknown)}: not an option of --runner {RUNNER} (its options: {known})"
        )
    return options_from(SparkOptions, parsed)


def check_java() -> None:
    """Spark's JVM needs Java 17 or newer, run as PySpark runs it (JAVA_HOME's, else `java` on PATH):
    where it is missing or older, one error naming the requirement."""
    home = os.getenv("JAVA_HOME")
    java = os.path.join(home, "bin", "java") if home else shutil.which("java")
    if java is None or not os.path.exists(java):
        raise InputError(f"--runner {RUNNER} needs Java {MIN_JAVA} or newer: no java found (JAVA_HOME or PATH)")
    try:
        said = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=60).stderr
    except (OSError, subprocess.SubprocessError) as error:
        raise InputError(
            f"--runner {RUNNER} needs Java {MIN_JAVA} or newer: {java} -version failed ({error})"
        ) from None
    found = re.search(r'version "(\d+)(?:\.(\d+))?', said)
    major = 0 if found is None else int(found.group(2) if found.group(1) == "1" else found.group(1))
    if major < MIN_JAVA:
        first = said.strip().splitlines()[0] if said.strip() else "no version"
        raise InputError(f"--runner {RUNNER} needs Java {MIN_JAVA} or newer: {java} is {first}")


def session_settings(options: SparkOptions) -> dict[str, str]:
    """The properties of a session madp builds: the user's, with this Python on the driver and the
    executors (where neither the properties nor PySpark's environment variables name one), and
    `DEFAULT_SETTINGS` where the user sets none of theirs."""
    settings = {**DEFAULT_SETTINGS, **options.settings}
    for key, variable in PYTHON_SETTINGS:
        if key not in settings and not os.environ.get(variable):
            settings[key] = sys.executable
    return settings


@contextlib.contextmanager
def _python_environment(settings: dict[str, str]) -> Iterator[None]:
    """While the SparkContext starts: PySpark's environment variables naming the properties' Pythons
    where unset (the context takes the executors' Python from PYSPARK_PYTHON, not from the property)."""
    added = {
        variable: settings[key] for key, variable in PYTHON_SETTINGS if key in settings and variable not in os.environ
    }
    os.environ.update(added)
    try:
        yield
    finally:
        for variable in added:
            os.environ.pop(variable, None)


@contextlib.contextmanager
def spark_session(options: SparkOptions, frame: DataFrame | None = None) -> Iterator[SparkSession]:
    """The session of the input DataFrame `frame`, else the caller's active SparkSession (either left
    running), or one built from `options` (Java checked first), its console quiet (log level WARN),
    stopped at the end."""
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession() if frame is None else frame.sparkSession
    if active is not None:
        with _task_failures_unlogged(active):
            yield active
        return
    check_java()
    settings = session_settings(options)
    builder = SparkSession.builder.master(options.master).appName("madp")
    for key, value in settings.items():
        builder = builder.config(key, value)
    before = _spark_properties()
    with _python_environment(settings):
        session = builder.getOrCreate()
    try:
        session.sparkContext.setLogLevel("WARN")
        with _task_failures_unlogged(session):
            yield session
    finally:
        session.stop()
        _clear_spark_properties(before)


@contextlib.contextmanager
def _task_failures_unlogged(session: SparkSession) -> Iterator[None]:
    """While madp's job runs: the `TASK_FAILURE_LOGGERS` off (a failed task's trace would come before
    madp's one-line error), then at their levels again (a caller's session keeps its logging)."""
    jvm = session.sparkContext._jvm
    log4j = jvm.org.apache.logging.log4j  # type: ignore[union-attr]  # a started context has its JVM
    levels = {name: log4j.LogManager.getLogger(name).getLevel() for name in TASK_FAILURE_LOGGERS}
    for name in TASK_FAILURE_LOGGERS:
        log4j.core.config.Configurator.setLevel(name, log4j.Level.OFF)
    try:
        yield
    finally:
        for name, level in levels.items():
            log4j.core.config.Configurator.setLevel(name, level)


def _spark_properties() -> set[str]:
    """The `spark.*` Java system properties of this process's Spark JVM (none before it is started)."""
    from pyspark import SparkContext

    jvm = SparkContext._jvm
    if jvm is None:
        return set()
    return {str(key) for key in jvm.java.lang.System.getProperties().keySet() if str(key).startswith("spark.")}


def _clear_spark_properties(before: set[str]) -> None:
    """Removes the `spark.*` system properties set since `before`: the JVM that starts the first SparkContext
    of a process keeps that context's settings as system properties, which every later session of the
    process would take as its defaults (a later session of the caller's would run with madp's settings)."""
    from pyspark import SparkContext

    for key in _spark_properties() - before:
        SparkContext._jvm.java.lang.System.clearProperty(key)  # type: ignore[union-attr]  # started by now
