"""Under CI=true a skipped test fails the run: a green CI run then says that every test ran. The one
exception is a test that needs hardware a CI machine does not have, whose skip reason starts with
NEEDS_A_GPU. Elsewhere (`make test` on a laptop) tests may skip, and `-rs` prints why."""

from __future__ import annotations

import os

import pytest

NEEDS_A_GPU = "needs a GPU"  # how the skip reason of a test that needs one starts


def skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str | None:
    """Why a test (or a whole module, at collection) was skipped; None if it was not (an expected
    failure, reported as a skip, is not one)."""
    if not report.skipped or hasattr(report, "wasxfail"):
        return None
    longrepr = report.longrepr  # (file, line, "Skipped: reason"), a list once it came from an xdist worker
    message = longrepr[2] if isinstance(longrepr, tuple | list) else str(longrepr)
    return message.removeprefix("Skipped: ")


class SkipsFailCi:
    """Notes every skip CI does not allow (from the xdist workers' reports too), lists them after the
    run and turns a passing run into a failed one."""

    def __init__(self) -> None:
        self.refused: list[tuple[str, str]] = []  # (node id, reason)

    def note(self, report: pytest.TestReport | pytest.CollectReport) -> None:
        reason = skip_reason(report)
        if reason is not None and not reason.startswith(NEEDS_A_GPU):
            self.refused.append((report.nodeid, reason))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.note(report)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        self.note(report)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.refused and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.refused:
            terminalreporter.section(f"skipped under CI=true, which fails the run (only '{NEEDS_A_GPU}' may skip)")
            for node, reason in self.refused:
                terminalreporter.line(f"{node}: {reason}", red=True)


def register(config: pytest.Config) -> None:
    """Under CI=true, on the process that reports the run (not on an xdist worker): SkipsFailCi."""
    if os.environ.get("CI") == "true" and not hasattr(config, "workerinput"):
        config.pluginmanager.register(SkipsFailCi(), "skips-fail-ci")
