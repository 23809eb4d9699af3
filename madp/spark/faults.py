"""What Spark recovered from under a madp run: executors lost (a killed JVM, a lost host) and task
attempts that failed and ran again. Spark retries both without a word to the caller; madp reports them
(`SparkFaults` in the run's report, and one warning line).

They are read from the driver's status REST API (`{sc.uiWebUrl}/api/v1/applications/{appId}`), the
driver's own record of its executors and of every stage attempt, served while the Spark UI is on
(PySpark's `statusTracker()` keeps only a stage's latest attempt, and no lost executor). With the UI off
nothing tells, and the counts are unknown (None), never 0. madp's jobs carry a job tag of the run's own,
so that in a caller's session only madp's tasks count; an executor counts where it was removed while
the run went on, but not by the driver itself (dynamic allocation's idle executors are not lost).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import urllib.request
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

from madp.core.reports import SparkFaults

if TYPE_CHECKING:
    from pyspark import SparkContext

LISTENER_SECONDS = 30.0  # the status store follows the scheduler's events a moment behind
BY_THE_DRIVER = "Executor killed by driver"  # a removal the driver asked for (dynamic allocation)
UNKNOWN = SparkFaults(executors_lost=None, tasks_retried=None)
# The driver's UI is served by this very process: never through an HTTP proxy of the environment
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))

log = logging.getLogger("madp.spark")


class ExecutorRow(NamedTuple):
    """An executor as the API lists it (`/allexecutors`)."""

    id: str  # "driver" for the driver
    active: bool
    remove_reason: str | None

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> ExecutorRow:
        return cls(str(row["id"]), bool(row["isActive"]), row.get("removeReason"))

    @property
    def lost(self) -> bool:
        """Removed, and not by the driver."""
        return self.id != "driver" and not self.active and not (self.remove_reason or "").startswith(BY_THE_DRIVER)


class JobRow(NamedTuple):
    """A job as the API lists it (`/jobs`)."""

    status: str  # RUNNING, SUCCEEDED, FAILED or UNKNOWN
    tags: tuple[str, ...]
    stages: tuple[int, ...]

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> JobRow:
        return cls(row["status"], tuple(row.get("jobTags", ())), tuple(row["stageIds"]))


class StageAttempt(NamedTuple):
    """An attempt of a stage as the API lists it (`/stages`: every attempt of every stage)."""

    stage: int
    failed_tasks: int

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> StageAttempt:
        return cls(int(row["stageId"]), int(row["numFailedTasks"]))


class StatusApi(NamedTuple):
    """The driver's status REST API for its application (its URL's start)."""

    base: str

    def read(self, path: str) -> list[dict[str, Any]]:
        """The API's JSON answer at `path` (an OSError or ValueError where it gives none)."""
        with _DIRECT.open(f"{self.base}/{path}", timeout=10) as answer:
            return json.load(answer)

    def lost_executors(self) -> dict[str, str]:
        """The executors removed other than by the driver: their removal's reason, by executor id."""
        executors = [ExecutorRow.from_json(row) for row in self.read("allexecutors")]
        return {each.id: each.remove_reason or "no reason given" for each in executors if each.lost}

    def settled_stages(self, tag: str) -> set[int]:
        """The stages of the jobs tagged `tag`, once the status store has seen every one end (it follows
        the scheduler's events a moment behind): TimeoutError where one still runs after LISTENER_SECONDS."""
        waited = time.monotonic()
        while True:
            jobs = [job for job in map(JobRow.from_json, self.read("jobs")) if tag in job.tags]
            if all(job.status != "RUNNING" for job in jobs):
                return {stage for job in jobs for stage in job.stages}
            if time.monotonic() - waited > LISTENER_SECONDS:
                raise TimeoutError(f"a job still runs after {LISTENER_SECONDS:.0f} s")
            time.sleep(0.1)

    def failed_tasks(self, stages: set[int]) -> int:
        """The failed task attempts of every attempt of `stages`."""
        attempts = [StageAttempt.from_json(row) for row in self.read("stages")]
        return sum(attempt.failed_tasks for attempt in attempts if attempt.stage in stages)


class FaultWatch:
    """A madp run's Spark jobs, tagged and watched: `faults()`, once they have run, says what Spark
    recovered from since the watch began."""

    def __init__(self, sc: SparkContext, command: str) -> None:
        self.command = command
        self.tag = f"madp-{uuid.uuid4().hex[:12]}"
        self.api = StatusApi(f"{sc.uiWebUrl}/api/v1/applications/{sc.applicationId}") if sc.uiWebUrl else None
        self.lost_before: dict[str, str] | None = None
        if self.api is None:
            log.info("%s: the Spark UI is off: executors lost and tasks retried unknown", command)
            return
        with self._unknown_where_unreadable():
            self.lost_before = self.api.lost_executors()

    @contextlib.contextmanager
    def _unknown_where_unreadable(self) -> Iterator[None]:
        try:
            yield
        except (OSError, ValueError, KeyError, TypeError) as error:  # TimeoutError and urllib's errors are OSErrors
            log.info("%s: the Spark UI's status API gave no answer (%s): executors lost unknown", self.command, error)

    def faults(self) -> SparkFaults:
        """The executors lost and the tasks retried since the watch began, the warning logged where there
        are any; unknown where the Spark UI is off or its API gave no answer."""
        if self.api is None or self.lost_before is None:
            return UNKNOWN
        with self._unknown_where_unreadable():
            stages = self.api.settled_stages(self.tag)
            lost = {each: why for each, why in self.api.lost_executors().items() if each not in self.lost_before}
            failed = self.api.failed_tasks(stages)
            if lost or failed:
                reasons = "".join(f"; executor {each}: {why}" for each, why in sorted(lost.items()))
                log.warning(
                    "Spark lost %d executor(s) during %s%s; %d task(s) failed and were retried",
                    len(lost),
                    self.command,
                    f" ({reasons[2:]})" if reasons else "",
                    failed,
                )
            return SparkFaults(executors_lost=len(lost), tasks_retried=failed)
        return UNKNOWN


@contextlib.contextmanager
def fault_watch(sc: SparkContext, command: str) -> Iterator[FaultWatch]:
    """Around a madp run's Spark jobs (`command` names it in the warning): the jobs this thread starts
    carry the watch's tag until the block ends."""
    watch = FaultWatch(sc, command)
    sc.addJobTag(watch.tag)
    try:
        yield watch
    finally:
        sc.removeJobTag(watch.tag)
