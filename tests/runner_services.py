"""The engines of the runner tier. Local services, each in processes of its own that a test session
starts and always stops: Beam's Python job service with an external worker pool (the PortableRunner),
and a Spark standalone cluster of a master and two one-core workers (pyspark's own jars and scripts).
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
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import NamedTuple

from conftest import SUITES

_START_SECONDS = 120.0  # a cold start on a busy 2-core machine takes ~10 s; this only catches a hang
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


class Service:
    """One process started in a session of its own, its output in a log file."""

    def __init__(self, name: str, command: list[str], directory: str, environment: dict[str, str] | None = None):
        self.name = name
        self.log = os.path.join(directory, f"{name}.log")
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**service_environment(), **(environment or {})},
                cwd=directory,
                start_new_session=True,
            )

    def log_tail(self, lines: int = 30) -> str:
        with open(self.log, errors="replace") as log:
            return "".join(log.readlines()[-lines:])

    def wait_for(self, ready: Callable[[], str | None]) -> str:
        """`ready()`'s answer once it has one; an error with the log if the service dies or hangs first."""
        start = time.monotonic()
        while time.monotonic() - start < _START_SECONDS:
            answer = ready()
            if answer:
                return answer
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.log_tail()}")
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} did not start in {_START_SECONDS:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        """Stop the service and every process of its session: politely, then for good."""
        for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                return  # the whole group is gone
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                continue
            if not _group_alive(self.process.pid):
                return


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def _file_text(path: str) -> str | None:
    return open(path).read().strip() if os.path.exists(path) else None


def _logged_after(service: Service, marker: str) -> str | None:
    """The word after `marker` in the service's log, once it is there."""
    with open(service.log, errors="replace") as log:
        text = log.read()
    return text.split(marker, 1)[1].split()[0] if marker in text else None


@contextlib.contextmanager
def portable_services() -> Iterator[list[str]]:
    """Beam's job service and an external worker pool on free ports; yields the PortableRunner's
    options. The job service (madp's start of Beam's, with a data plane that flushes by size only)
    runs each job with one SDK worker, a process the pool starts."""
    with tempfile.TemporaryDirectory(prefix="madp-portable-") as directory:
        services: list[Service] = []
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
                )
            )
            services.append(
                Service(
                    "worker_pool",
                    [sys.executable, "-c", _WORKER_POOL, "--service_port=0"],
                    directory,
                )
            )
            job_port = services[0].wait_for(lambda: _file_text(port_file))
            pool = services[1].wait_for(lambda: _logged_after(services[1], "worker pool servicer at port:"))
            yield [
                "--runner=PortableRunner",
                f"--job_endpoint=localhost:{job_port}",
                "--environment_type=EXTERNAL",
                f"--environment_config={pool}",
            ]
        finally:
            for service in services:
                service.stop()


class SparkCluster(NamedTuple):
    """A running Spark standalone cluster: the URL jobs are submitted to, the master's web UI (its state
    as JSON at /json/), its processes, and the folder of their logs and the workers' work folders (each
    executor's stdout and stderr)."""

    master_url: str
    web_ui: str
    master: Service
    workers: list[Service]
    directory: str

    def state(self) -> dict:
        """The master's view: its workers (`aliveworkers`), applications and their cores."""
        return loopback_json(f"{self.web_ui}/json/")

    def log_tails(self, lines: int = 30) -> str:
        """The end of every log of the cluster, the executors' stderr included: what a failure shows."""
        logs = [service.log for service in (self.master, *self.workers)]
        logs += sorted(
            os.path.join(root, name)
            for root, _, names in os.walk(self.directory)
            for name in names
            if name == "stderr"  # an executor's, under its worker's work folder: app-ID/EXECUTOR/stderr
        )
        tails = []
        for path in logs:
            with open(path, errors="replace") as log:
                tails.append(f"--- {os.path.relpath(path, self.directory)}\n" + "".join(log.readlines()[-lines:]))
        return "\n".join(tails)


def spark_home() -> str:
    """The installed pyspark's folder: it ships Spark's jars and bin/spark-class."""
    import pyspark

    return os.path.dirname(os.path.abspath(pyspark.__file__))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# Straight to the local services: an HTTP proxy of the environment does not reach this machine's loopback
_LOOPBACK = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def loopback_json(url: str):
    """The JSON a service of this machine answers at `url` (a Spark master's or driver's web UI)."""
    with _LOOPBACK.open(url, timeout=10) as answer:
        return json.load(answer)


def _answers(url: str) -> bool:
    try:
        _LOOPBACK.open(url, timeout=5).close()
    except (urllib.error.URLError, ConnectionError, TimeoutError):  # not listening yet
        return False
    return True


@contextlib.contextmanager
def spark_cluster(workers: int = 2, cores: int = 1, memory: str = "2g") -> Iterator[SparkCluster]:
    """A master and `workers` workers of `cores` cores and `memory` each, on loopback addresses and free ports,
    started from the installed pyspark (Java 17 or newer on PATH); yields the cluster once every worker
    has registered with the master, and stops all its processes (executors and their Python workers
    included) on leaving, even on failure."""
    with tempfile.TemporaryDirectory(prefix="madp-spark-") as directory:
        spark_class = os.path.join(spark_home(), "bin", "spark-class")
        environment = {
            "SPARK_HOME": spark_home(),
            "SPARK_LOCAL_IP": "127.0.0.1",
            "SPARK_LOCAL_DIRS": os.path.join(directory, "local"),  # shuffle and spill files
        }
        port, web_port = free_port(), free_port()
        master_url, web_ui = f"spark://127.0.0.1:{port}", f"http://127.0.0.1:{web_port}"
        services: list[Service] = []
        try:
            master_command = ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(port)]
            master = Service(
                "master",
                [spark_class, *master_command, "--webui-port", str(web_port)],
                directory,
                environment,
            )
            services.append(master)
            master.wait_for(lambda: web_ui if _answers(f"{web_ui}/json/") else None)
            for number in range(workers):
                work = os.path.join(directory, f"worker-{number}")
                worker_command = ["org.apache.spark.deploy.worker.Worker", "--cores", str(cores), "--memory", memory]
                # A loopback address of its own (127.0.0.2, ...): Spark runs a task's speculative copy on
                # another host than the task's, so on one host it never would
                host = f"127.0.0.{number + 2}"
                services.append(
                    Service(
                        f"worker-{number}",
                        # port 0: a free port of the worker's choosing, web UI included (all would take 8081)
                        [spark_class, *worker_command, "--host", host, "--work-dir", work, "--webui-port", "0"]
                        + [master_url],
                        directory,
                        {**environment, "SPARK_LOCAL_IP": host},
                    )
                )
            for worker in services[1:]:
                worker.wait_for(lambda worker=worker: _logged_after(worker, "Successfully registered with master"))
            yield SparkCluster(master_url, web_ui, master, services[1:], directory)
        finally:
            for service in reversed(services):
                service.stop()


class _Process(NamedTuple):
    parent: int  # its parent's pid
    computing: bool  # on a CPU or waiting for one (state R), not asleep
    command: str  # its command line


def _processes() -> dict[int, _Process]:
    """Every process of this machine, by pid (from /proc)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                state, parent = stat.read().rsplit(")", 1)[1].split()[:2]  # after the command's name
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                command = cmdline.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # it ended while we read
            continue
        found[int(entry)] = _Process(int(parent), state == "R", command)
    return found


def executors(cluster: SparkCluster, running_python: bool = False, computing: bool = False) -> list[int]:
    """The pids of the cluster's executor JVMs (CoarseGrainedExecutorBackend, each a child of one of its
    workers), those with a PySpark worker process under them only where `running_python`, and only those
    with one computing (a task running in it) where `computing`."""
    processes = _processes()
    worker_pids = {worker.process.pid for worker in cluster.workers}
    found = [
        pid
        for pid, process in processes.items()
        if process.parent in worker_pids and "CoarseGrainedExecutorBackend" in process.command
    ]
    # an executor starts PySpark's daemon, which forks a Python worker (the same command) for its tasks
    daemons = {pid: process for pid, process in processes.items() if "pyspark.daemon" in process.command}
    if running_python:
        found = [pid for pid in found if pid in {daemon.parent for daemon in daemons.values()}]
    if computing:
        workers = [process for process in daemons.values() if process.parent in daemons]
        busy = {daemons[worker.parent].parent for worker in workers if worker.computing}
        found = [pid for pid in found if pid in busy]
    return sorted(found)


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
            targets = executors(cluster, running_python=True, computing=due and mid_task)
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
