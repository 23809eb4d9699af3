"""A Spark standalone cluster on this machine, for a laptop, a benchmark or a test: a master and N workers
started from the installed pyspark's own jars and `bin/spark-class` (Java 17 or newer on PATH), on
loopback addresses and free ports, each in a session of its own so that stopping it stops the processes it
started too (a worker's executors and their Python workers) and nothing else.

    python -m madp.tools.spark_standalone [--workers 2] [--cores 1] [--memory 3g]

prints the master's URL (for `--spark-master`) and its web UI, and runs the cluster until interrupted.
From Python, `with spark_cluster() as cluster:` yields a `SparkCluster` and stops it on leaving.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import NamedTuple

START_SECONDS = 120.0  # a cold start on a busy 2-core machine takes ~10 s; this only catches a hang
EXECUTOR_CLASS = "CoarseGrainedExecutorBackend"  # in an executor JVM's command line


class Service:
    """One process started in a session of its own, with `environment` (the whole of it), its output
    in a log file under `directory`."""

    def __init__(self, name: str, command: list[str], directory: str, environment: dict[str, str]):
        self.name = name
        self.log = os.path.join(directory, f"{name}.log")
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=environment,
                cwd=directory,
                start_new_session=True,
            )

    def log_tail(self, lines: int = 30) -> str:
        with open(self.log, errors="replace") as log:
            return "".join(log.readlines()[-lines:])

    def wait_for(self, ready: Callable[[], str | None]) -> str:
        """`ready()`'s answer once it has one; an error with the log if the service dies or hangs first."""
        start = time.monotonic()
        while time.monotonic() - start < START_SECONDS:
            answer = ready()
            if answer:
                return answer
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.log_tail()}")
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} did not start in {START_SECONDS:.0f} s:\n{self.log_tail()}")

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


def logged_after(service: Service, marker: str) -> str | None:
    """The word after `marker` in the service's log, once it is there."""
    with open(service.log, errors="replace") as log:
        text = log.read()
    return text.split(marker, 1)[1].split()[0] if marker in text else None


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

    def executors(
        self, running_python: bool = False, computing: bool = False, table: dict[int, Process] | None = None
    ) -> list[int]:
        """The pids of the cluster's executor JVMs (each a child of one of its workers), those with a
        PySpark worker process under them only where `running_python`, and only those with one computing
        (a task running in it) where `computing`; from `table` (`processes()`'s) where given, else from
        the processes now."""
        found = processes() if table is None else table
        worker_pids = {worker.process.pid for worker in self.workers}
        executors = [
            pid for pid, process in found.items() if process.parent in worker_pids and EXECUTOR_CLASS in process.command
        ]
        # an executor starts PySpark's daemon, which forks a Python worker (the same command) for its tasks
        daemons = {pid: process for pid, process in found.items() if "pyspark.daemon" in process.command}
        if running_python:
            executors = [pid for pid in executors if pid in {daemon.parent for daemon in daemons.values()}]
        if computing:
            busy = {
                daemons[worker.parent].parent
                for worker in daemons.values()
                if worker.parent in daemons and worker.computing
            }
            executors = [pid for pid in executors if pid in busy]
        return sorted(executors)


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
def spark_cluster(
    workers: int = 2, cores: int = 1, memory: str = "2g", environment: dict[str, str] | None = None
) -> Iterator[SparkCluster]:
    """A master (127.0.0.1) and `workers` workers (127.0.0.2, ...) of `cores` cores and `memory` each, on
    free ports;
    yields the cluster once every worker has registered with the master, and stops all its processes
    (executors and their Python workers included) on leaving, even on failure. The processes run with
    `environment` (this process's by default): the executors' Python workers inherit it, a PYTHONPATH
    that finds madp included."""
    with tempfile.TemporaryDirectory(prefix="madp-spark-") as directory:
        spark_class = os.path.join(spark_home(), "bin", "spark-class")
        cluster_environment = {
            **(os.environ if environment is None else environment),
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
                cluster_environment,
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
                        {**cluster_environment, "SPARK_LOCAL_IP": host},
                    )
                )
            for worker in services[1:]:
                worker.wait_for(functools.partial(logged_after, worker, "Successfully registered with master"))
            yield SparkCluster(master_url, web_ui, master, services[1:], directory)
        finally:
            for service in reversed(services):
                service.stop()


class Process(NamedTuple):
    """A process of this machine, as /proc shows it."""

    parent: int  # its parent's pid
    computing: bool  # on a CPU or waiting for one (state R), not asleep
    command: str  # its command line


def processes() -> dict[int, Process]:
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
        found[int(entry)] = Process(int(parent), state == "R", command)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--cores", type=int, default=1, help="cores of each worker")
    parser.add_argument("--memory", default="3g", help="memory of each worker's executors (e.g. 3g)")
    args = parser.parse_args()
    with spark_cluster(args.workers, args.cores, args.memory) as cluster:
        print(f"master {cluster.master_url}  web UI {cluster.web_ui}  (Ctrl-C stops the cluster)", flush=True)
        stop = {signal.SIGINT, signal.SIGTERM}
        signal.pthread_sigmask(signal.SIG_BLOCK, stop)  # taken by sigwait, so the cluster is stopped on leaving
        signal.sigwait(stop)


if __name__ == "__main__":
    main()
