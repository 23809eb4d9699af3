"""The job server that Beam's FlinkRunner and SparkRunner start on this machine, made ready before a job
does any work: its `java` found and its jar local, or one `InputError` that names the option to pass.

Without `--job_endpoint`, these runners start Beam's job server for the runner (a Java program, from a
jar Beam fetches from Maven Central into its cache at the first run) and submit through it. Where the
jar cannot be fetched (behind a firewall, a registry without Beam's runner artifacts), Beam's own
failure comes at submission, as a long traceback, after the job has cleared its output; here it comes
first. The jar is fetched with Beam's own functions (the URL Beam derives from its version and the
runner's options, the cache Beam reads), so Beam finds it there when the job is submitted.

With `--flink_submit_uber_jar` (to a remote Flink master) or `--spark_submit_uber_jar`, Beam starts no
job server here (it uploads the jar to the cluster, and takes the Flink version from the cluster at
submission), so nothing is prepared.
"""

from __future__ import annotations

import os
import shutil
import urllib.parse
from collections.abc import Callable
from typing import NamedTuple
from urllib.error import HTTPError, URLError

import grpc
from apache_beam.options.pipeline_options import (
    FlinkRunnerOptions,
    JobServerOptions,
    PipelineOptions,
    PortableOptions,
    SparkRunnerOptions,
    StandardOptions,
)
from apache_beam.runners.portability.flink_runner import MAGIC_HOST_NAMES, FlinkJarJobServer, FlinkRunner
from apache_beam.runners.portability.spark_runner import SparkJarJobServer, SparkRunner
from apache_beam.runners.runner import create_runner
from apache_beam.utils.subprocess_server import JavaJarServer

from madp.core.errors import InputError

JOB_ENDPOINT = "run a job server and pass --job_endpoint HOST:PORT"


class JarJobServer(NamedTuple):
    """A runner that starts a job server of Beam's from a jar, unless given `--job_endpoint`."""

    runner: type  # Beam's runner class
    system: str  # what the job server submits to: "Flink", "Spark"
    server: type  # Beam's job server of the runner, which derives the jar's path or URL from the options
    runner_options: type[PipelineOptions]  # the runner's options, `jar_option` among them
    jar_option: str  # the option for a jar of one's own, by its name in `runner_options`
    uploads_uber_jar: Callable[[PipelineOptions], bool]  # whether the runner uploads a jar, starting none here

    def named_by(self, runner: str) -> bool:
        """Whether `--runner runner` picks this runner, as Beam resolves the name: the class's name in any
        case, with or without its "Runner" suffix, or its full path."""
        name = self.runner.__name__.lower()
        return runner.lower() in (name, name.removesuffix("runner")) or runner == (
            f"{self.runner.__module__}.{self.runner.__name__}"
        )

    @property
    def jar_flag(self) -> str:
        return f"--{self.jar_option}"


def _flink_uploads_uber_jar(options: PipelineOptions) -> bool:
    flink = options.view_as(FlinkRunnerOptions)
    return flink.flink_submit_uber_jar and flink.flink_master.strip() not in MAGIC_HOST_NAMES


def _spark_uploads_uber_jar(options: PipelineOptions) -> bool:
    return options.view_as(SparkRunnerOptions).spark_submit_uber_jar


JAR_JOB_SERVERS = (
    JarJobServer(
        FlinkRunner, "Flink", FlinkJarJobServer, FlinkRunnerOptions, "flink_job_server_jar", _flink_uploads_uber_jar
    ),
    JarJobServer(
        SparkRunner, "Spark", SparkJarJobServer, SparkRunnerOptions, "spark_job_server_jar", _spark_uploads_uber_jar
    ),
)


def prepare_runner(options: PipelineOptions) -> None:
    """Before a job on `options` starts work: refuse a runner Beam does not know, and where the runner will
    start Beam's job server on this machine, find the Java launcher and fetch the job server's jar into
    Beam's cache (unless there already), or with a given `--job_endpoint`, wait for it to answer; each an
    InputError naming the option that fixes it. Other runners pass."""
    _check_runner_name(options.view_as(StandardOptions).runner)
    portable = options.view_as(PortableOptions)
    if portable.job_endpoint:
        _check_endpoint(portable.job_endpoint, portable.job_server_timeout)
        return
    runner = options.view_as(StandardOptions).runner or ""
    for server in JAR_JOB_SERVERS:
        if server.named_by(runner) and not server.uploads_uber_jar(options):
            _check_java(server, options)
            _fetch_jar(server, options)


def _check_runner_name(runner: str | None) -> None:
    """A runner name Beam resolves (its own names, or a PipelineRunner subclass by its qualified name), as
    Beam does when the pipeline is built: there, an unknown one is a traceback after the output was
    cleared."""
    if not runner:
        return  # Beam's default
    try:
        create_runner(runner)
    except (ValueError, ImportError, AttributeError) as error:
        raise InputError(f"--runner {runner}: {error} ('local' is madp's in-process engine)") from None


def _check_endpoint(endpoint: str, timeout_s: int) -> None:
    """A job server answers at `endpoint` within `timeout_s` (`--job_server_timeout`), checked before the job
    clears its output: where none does, Beam's submission fails later with a gRPC traceback."""
    if endpoint == "embed":  # Beam's job service in this process
        return
    with grpc.insecure_channel(endpoint) as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise InputError(
                f"--job_endpoint {endpoint}: no job server answered there within {timeout_s} s "
                "(--job_server_timeout): start it, or leave --job_endpoint out for the runner to start one"
            ) from None


def _check_java(server: JarJobServer, options: PipelineOptions) -> None:
    launcher = options.view_as(JobServerOptions).job_server_java_launcher
    if shutil.which(launcher) is None:
        raise InputError(
            f"{server.runner.__name__} starts Beam's {server.system} job server, a Java program, on this "
            f"machine, but there is no `{launcher}` executable here: install Java (or pass "
            f"--job_server_java_launcher PATH), or {JOB_ENDPOINT}"
        )


def _fetch_jar(server: JarJobServer, options: PipelineOptions) -> None:
    given = getattr(options.view_as(server.runner_options), server.jar_option)
    if given and not os.path.exists(given) and not urllib.parse.urlparse(given).scheme:
        raise InputError(f"{server.jar_flag} {given}: no such file")
    url = server.server(options).path_to_jar()
    try:
        JavaJarServer.local_jar(url, options.view_as(JobServerOptions).jar_cache_dir)
    except (RuntimeError, OSError) as error:  # Beam's RuntimeError after the fetches that failed
        failed = f"could not be fetched from {url} ({_fetch_failures(error)})"
        if given:
            raise InputError(
                f"{server.runner.__name__}'s job server jar {failed}: pass {server.jar_flag} a path "
                f"or URL this machine can read, or {JOB_ENDPOINT}"
            ) from error
        _, artifact, version, _ = url.rsplit("/", 3)  # Beam's Maven layout: .../ARTIFACT/VERSION/JAR
        raise InputError(
            f"{server.runner.__name__} needs Beam's {server.system} job server jar "
            f"({JavaJarServer.BEAM_GROUP_ID}:{artifact}:{version}), which {failed}: download it where it "
            f"can be, and pass {server.jar_flag} PATH, or {JOB_ENDPOINT}"
        ) from error


def _fetch_failures(error: BaseException) -> str:
    """Why each fetch behind `error` failed, first try first (Beam tries Google's mirror of Maven Central
    after Maven Central, and raises its own error from the last failure)."""
    reasons: list[str] = []
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, HTTPError):
            reasons.append(f"HTTP {cause.code}")
        elif isinstance(cause, URLError):
            reasons.append(str(cause.reason))
        cause = cause.__cause__ or cause.__context__
    if not reasons:
        return str(error)
    first, *mirrors = reversed(reasons)
    return first + "".join(f"; then from Google's mirror of Maven Central: {reason}" for reason in mirrors)
