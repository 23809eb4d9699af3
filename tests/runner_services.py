"""The engines of the runner tier. Local services, each in processes of its own that a test session
starts and always stops: Beam's Python job service with an external worker pool (the PortableRunner),
and a Spark standalone cluster of a master and two one-core workers (pyspark's own jars and scripts,
started by `madp.tools.spark_standalone` with the services' environment).
And Beam's Prism runner, a Go binary built once per Beam version into a cache folder
(`python tests/runner_services.py prism`, which `make prism` and `make test` run, builds it and
prints its path).

Every service runs in a new session, so that stopping it stops the processes it started too (the
worker pool's SDK workers, a worker's executors and their Python workers) and nothing else.

Under CI (CI=true) an engine that cannot be had here (no Go to build Prism, no Java for Spark) fails
its tests: the tier never skips there; elsewhere they skip, saying why.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

from conftest import SUITES

from madp.tools.spark_standalone import Service, SparkCluster, logged_after

# Beam's worker pool logs its port at INFO on the root logger, which has no handler of its own: the
# line shows only where an import happened to log a warning first (none does with the gcp extra
# installed), so the pool runs with a handler.
_WORKER_POOL = (
    "import logging, sys; logging.basicConfig(level=logging.INFO); "
    "from apache_beam.runners.worker import worker_pool_main; worker_pool_main.main(sys.argv)"
)
PRISM_CACHE_VARIABLE = "MADP_PRISM_CACHE"  # the folder of the Prism binaries, one folder per Beam version
PRISM_PACKAGE = "github.com/apache/beam/sdks/v2/go/cmd/prism"


class EngineUnavailable(Exception):
    """An engine of the tier cannot be had on this machine (a program it needs is not on PATH)."""


def tier_required() -> bool:
    """Whether the runner tier must run: under CI a missing engine is a failure, not a skip."""
    return os.environ.get("CI") == "true"


def prism_cache(beam_version: str) -> str:
    """The folder of the Prism binary for a Beam version: ~/.cache/madp/prism/VERSION, or under
    $MADP_PRISM_CACHE."""
    root = os.environ.get(PRISM_CACHE_VARIABLE) or os.path.join(os.path.expanduser("~"), ".cache", "madp", "prism")
    return os.path.join(root, beam_version)


def prism_binary(beam_version: str | None = None) -> str:
    """The path of Beam's Prism runner for `beam_version` (the installed Beam's by default): the cached
    binary, else built into the cache with `go install` (two to three minutes the first time; Go's
    module and build caches make a later build of another version fast). A process that finds another
    building it waits for that build. EngineUnavailable where Go is not on PATH."""
    if beam_version is None:
        import apache_beam

        beam_version = apache_beam.__version__
    folder = prism_cache(beam_version)
    binary = os.path.join(folder, "prism")
    if os.access(binary, os.X_OK):
        return binary
    go = shutil.which("go")
    if go is None:
        raise EngineUnavailable(f"no `go` on PATH to build Beam's Prism runner ({PRISM_PACKAGE}@v{beam_version})")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.access(binary, os.X_OK):  # built by the process that held the lock
            return binary
        with tempfile.TemporaryDirectory(dir=folder) as build:  # an interrupted build leaves no binary
            command = [go, "install", f"{PRISM_PACKAGE}@v{beam_version}"]
            built = subprocess.run(command, env={**os.environ, "GOBIN": build}, capture_output=True, text=True)
            if built.returncode != 0:
                raise RuntimeError(f"`{' '.join(command)}` failed ({built.returncode}):\n{built.stderr[-3000:]}")
            os.replace(os.path.join(build, "prism"), binary)
    return binary


def service_environment() -> dict[str, str]:
    """The services' environment: `python` is this interpreter (the worker pool starts each SDK worker
    as `python -c ...` from PATH), and madp and the test modules are imported from the tests' source
    tree, so that workers unpickle our DoFns and the tests' with the driver's code."""
    import madp

    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    source = os.path.dirname(os.path.dirname(os.path.abspath(madp.__file__)))
    tests = os.path.dirname(os.path.abspath(__file__))
    suites = [os.path.join(tests, suite) for suite in SUITES]  # the test modules, by file name (conftest)
    env["PYTHONPATH"] = os.pathsep.join(path for path in (source, tests, *suites, env.get("PYTHONPATH")) if path)
    return env


def _file_text(path: str) -> str | None:
    return open(path).read().strip() if os.path.exists(path) else None


@contextlib.contextmanager
def portable_services() -> Iterator[list[str]]:
    """Beam's job service and an external worker pool on free ports; yields the PortableRunner's
    options. The job service (madp's start of Beam's, with a data plane that flushes by size only)
    runs each job with one SDK worker, a process the pool starts."""
    with tempfile.TemporaryDirectory(prefix="madp-portable-") as directory:
        services: list[Service] = []
        environment = service_environment()
        try:
            port_file = os.path.join(directory, "job_service.port")
            services.append(
                Service(
                    "job_service",
                    [
                        sys.executable,
                        "-m",
                        "madp.beam.local_job_service",
                        "--port=0",  # a free port, written to the port file once the service listens
                        f"--port_file={port_file}",
                    ],
                    directory,
                    environment,
                )
            )
            services.append(
                Service(
                    "worker_pool",
                    [sys.executable, "-c", _WORKER_POOL, "--service_port=0"],
                    directory,
                    environment,
                )
            )
            job_port = services[0].wait_for(lambda: _file_text(port_file))
            pool = services[1].wait_for(lambda: logged_after(services[1], "worker pool servicer at port:"))
            yield [
                "--runner=PortableRunner",
                f"--job_endpoint=localhost:{job_port}",
                "--environment_type=EXTERNAL",
                f"--environment_config={pool}",
            ]
        finally:
            for service in services:
                service.stop()


class ExecutorKill:
    """The executor a kill took: its pid, once killed."""

    def __init__(self) -> None:
        self.pid: int | None = None


@contextlib.contextmanager
def executor_killed(
    cluster: SparkCluster, after_seconds: float = 1.0, patience: float = 300.0, mid_task: bool = False
) -> Iterator[ExecutorKill]:
    """Kill one executor JVM of the cluster (SIGKILL, as a lost machine or the OOM killer does) while the
    block runs a job on it: `after_seconds` after an executor first runs Python work (a PySpark worker
    under it), so that tasks are running there and their results are lost with it; where `mid_task`, at
    the first moment after that when one of its Python workers computes, so that a task fails with it.
    Yields the kill (its `pid` set once done); leaving the block without an exception fails if no
    executor was killed (the job ended before any ran Python work: make it run longer)."""
    kill = ExecutorKill()
    finished = threading.Event()

    def watch() -> None:
        start, due = time.monotonic(), False
        while not finished.is_set() and time.monotonic() - start < patience:
            targets = cluster.executors(running_python=True, computing=due and mid_task)
            if targets and not due:  # the first Python work: the kill is due `after_seconds` later
                due = True
                if finished.wait(after_seconds):
                    return
                continue
            if targets:
                try:
                    os.kill(targets[0], signal.SIGKILL)
                except ProcessLookupError:  # it ended meanwhile: take another
                    continue
                kill.pid = targets[0]
                return
            time.sleep(0.01 if due else 0.05)

    killer = threading.Thread(target=watch, name="executor-killer", daemon=True)
    killer.start()
    try:
        yield kill
    finally:
        finished.set()
        killer.join()
    assert kill.pid is not None, "no executor ran Python work while the block ran: nothing was killed"


if __name__ == "__main__":
    if sys.argv[1:] != ["prism"]:
        sys.exit(f"usage: {sys.argv[0]} prism")
    try:
        print(prism_binary())
    except EngineUnavailable as missing:
        if tier_required():
            sys.exit(f"{missing}: CI runs the Prism tier (CI=true), so Go must be installed")
        print(f"{missing}: the Prism tier's tests will skip", file=sys.stderr)
