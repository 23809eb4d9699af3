"""Progress of long local work: done/total, rate and ETA, logged at most every few seconds."""

from __future__ import annotations

import logging
import time


class Progress:
    def __init__(self, log: logging.Logger, what: str, total: int, unit: str, every_s: float = 5.0):
        self.log, self.what, self.total, self.unit, self.every_s = log, what, total, unit, every_s
        self.started = self.last = time.perf_counter()

    def update(self, done: int, note: str = "") -> None:
        """Log done/total, rate and ETA if `every_s` passed since the last line, or at the end."""
        now = time.perf_counter()
        if now - self.last < self.every_s and done < self.total:
            return
        self.last = now
        rate = done / max(now - self.started, 1e-9)
        eta = (self.total - done) / rate if rate > 0 else float("inf")
        self.log.info(
            "%s: %d/%d %s, %.1f %s/s, ETA %.0f s%s", self.what, done, self.total, self.unit, rate, self.unit, eta, note
        )
