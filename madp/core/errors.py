"""The one error madp reports to users: bad input, options or outputs, with a message that names
the file, row, option or output and says why."""

from __future__ import annotations

import math
import os


class InputError(ValueError):
    """Bad input or options, with a message that names the file, row and reason."""


class CheckFailed(InputError):
    """An independent check (a verifier, an audit) found the output does not have the property it
    must have; `result` is the check's report. Commands exit 1 on it, as on a failed verification."""

    def __init__(self, message: str, result: dict | None = None):
        super().__init__(message)
        self.result = result or {}


def positive(value: float) -> bool:
    """Whether an option's number is above 0 and finite: argparse's float and YAML read "inf" and
    "nan", which train on NaN or crash the accountant deep inside instead of being refused."""
    return value > 0 and math.isfinite(value)


def nonnegative(value: float) -> bool:
    """Whether an option's number is 0 or above and finite (as `positive`, 0 allowed)."""
    return value >= 0 and math.isfinite(value)


def check_memory(needed_bytes: float, what: str, remedy: str) -> None:
    """Refuse, before allocating, what would hold more than half of this machine's physical memory,
    so that it is refused by name instead of killed: "{what} about N GiB in memory, more than half
    of this machine's M GiB: {remedy}" (N rounded to whole GiB in integers: no float overflow at any size)."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if needed_bytes > memory / 2:
        raise InputError(
            f"{what} about {int((needed_bytes + 2**29) // 2**30):,} GiB in memory, more than half of this machine's "
            f"{memory / 2**30:.0f} GiB: {remedy}"
        )
