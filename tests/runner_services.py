"""The local services of the runner tier, each in processes of its own that a test session starts and
always stops: Beam's Python job service with an external worker pool (the PortableRunner).

Every service runs in a new session, so that stopping it stops the processes it started too (the
worker pool's SDK workers) and nothing else.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

from conftest import SUITES

_START_SECONDS = 120.0  # a cold start on a busy 2-core machine takes ~10 s; this only catches a hang


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

    def __init__(self, name: str, command: list[str], directory: str):
        self.name = name
        self.log = os.path.join(directory, f"{name}.log")
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=service_environment(),
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
                    [sys.executable, "-m", "apache_beam.runners.worker.worker_pool_main", "--service_port=0"],
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
