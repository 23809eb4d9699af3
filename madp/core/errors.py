"""The one error madp reports to users: bad input, options or outputs, with a message that names
the file, row, option or output and says why; and what turns the machine's limits into it: the memory
this process may use (the machine's, or its cgroup's limit), a full file system."""

from __future__ import annotations

import errno
import math
import os
import re
import string
from collections.abc import Callable
from typing import NamedTuple


class InputError(ValueError):
    """Bad input or options, with a message that names the file, row and reason."""


class OptionError(InputError):
    """Bad options, said with their parameters' names: `template` names each by a placeholder, `{epsilon}`,
    and its values by position, `{0}`. The message (`str`) names the parameters as a Python caller passes
    them (`epsilon`); the command line renders them as its flags (`named(flag_of)`: `--epsilon`). A value
    that is an OptionError (the error one wraps) names its parameters the same way."""

    def __init__(self, template: str, *values: object):
        self.template, self.values = template, values
        super().__init__(self.named(str))

    def named(self, name: Callable[[str], str]) -> str:
        """The message with each parameter called `name(parameter)`."""
        parameters = {
            field: name(field)
            for _, field, _, _ in string.Formatter().parse(self.template)
            if field and not field.isdigit()
        }
        values = (value.named(name) if isinstance(value, OptionError) else value for value in self.values)
        return self.template.format(*values, **parameters)

    def __reduce__(self):  # rebuilt from its template (a worker process's error reaches the driver pickled)
        return type(self), (self.template, *self.values)


class DiskFull(InputError):
    """A write failed because its file system is full (or the user's disk quota is spent): the message names
    the path and what the file system holds; the command line adds what was kept and how to go on."""


class CheckFailed(InputError):
    """An independent check (a verifier, an audit) found the output does not have the property it
    must have; `result` is the check's report. Commands exit 1 on it, as on a failed verification."""

    def __init__(self, message: str, result: dict | None = None):
        super().__init__(message)
        self.result = result or {}


# TensorFlow's run-time errors (OpError) open with where the failed op was defined: a header, "Detected at
# node N defined at (most recent call last):" and that stack; an eager one names the function it ran in
# and ends with its op's name; Keras wraps an error of a layer's call in a header that names the layer.
_PREAMBLE = ("Graph execution error:", "Detected at node", "Exception encountered when calling")
_WHERE = re.compile(
    r"^(?:Detected at node '?(?P<node>[^' ]+)'? defined at"
    r"|Exception encountered when calling (?:layer '(?P<layer>[^']+)'|(?P<call>\S+?\.call)\(\)))",
    re.MULTILINE,
)
# An eager op's function and name; tf.data's words on the function of a step of its pipeline
_DECORATION = re.compile(
    r"^\{\{function_node [^}]*\}\}\s*|\s*name:\s*$"
    r"|Error in user-defined function passed to \S+ transformation with iterator: \S+: (?:Name: [^,]*, )?"
)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Keras 3 prints its errors bold


def one_line(error: BaseException) -> str:
    """An exception as one line: its class and the first line of its message that says what failed. Of a
    TensorFlow run-time error, that is the line after its preamble (`_PREAMBLE`: the stack of the op's
    definition, Keras' header), with the node or layer that failed: "InvalidArgumentError: indices[0,0]
    = 23 is not in [0, 4) (at node model/embedding/embedding_lookup)"."""
    text = _ANSI.sub("", str(error))
    lines = [line for line in text.splitlines() if line.strip()]
    said = next(
        (line for line in lines if not line[0].isspace() and not line.startswith(_PREAMBLE)), lines[0] if lines else ""
    )
    said = _DECORATION.sub("", said.strip())
    where = _WHERE.search(text)
    at = ""
    if where is not None:
        at = (
            f" (at node {where['node']})"
            if where["node"]
            else f" (in {where['call'] or 'layer ' + repr(where['layer'])})"
        )
    return type(error).__name__ + (f": {said}" if said else "") + at


def positive(value: float) -> bool:
    """Whether an option's number is above 0 and finite: argparse's float and YAML read "inf" and
    "nan", which train on NaN or crash the accountant deep inside instead of being refused."""
    return value > 0 and math.isfinite(value)


def nonnegative(value: float) -> bool:
    """Whether an option's number is 0 or above and finite (as `positive`, 0 allowed)."""
    return value >= 0 and math.isfinite(value)


def size_text(size: float) -> str:
    """A size in whole GiB, MiB or KiB (rounded, integers: no float overflow at any finite size), or bytes."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift:
            return f"{int((size + (1 << (shift - 1))) // (1 << shift)):,} {unit}"
    return f"{int(size)} B"


CGROUP_ROOT = "/sys/fs/cgroup"  # where the cgroup file systems are mounted
PROC_CGROUPS = "/proc/self/cgroup"  # this process's cgroup in each hierarchy


class MemoryLimit(NamedTuple):
    """The memory this process may use, and the cgroup file that sets it (None: the machine's memory)."""

    size: int
    cgroup_file: str | None

    def named(self) -> str:
        if self.cgroup_file is None:
            return f"this machine's {size_text(self.size)}"
        return f"the {size_text(self.size)} memory limit of this process's cgroup ({self.cgroup_file})"


def memory_limit() -> MemoryLimit:
    """The smaller of this machine's physical memory and the memory limit of this process's cgroup (a
    container's limit, or a cgroup above it): past the limit the kernel kills the process, whatever the
    machine holds."""
    limit = MemoryLimit(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), None)
    for path in _cgroup_limit_files():
        size = _cgroup_limit(path)
        if size is not None and size < limit.size:
            limit = MemoryLimit(size, path)
    return limit


def _cgroup_limit_files() -> list[str]:
    """The files that may limit this process's memory: cgroup v2's memory.max and v1's
    memory.limit_in_bytes, of its own cgroup and of every cgroup above it, in the hierarchies that
    /proc/self/cgroup names. A container with a cgroup namespace of its own sees its cgroup as the
    root; one without sees a path that its mount does not hold, and then the mount's root files (its
    own cgroup's) are still among these."""
    try:
        with open(PROC_CGROUPS) as handle:
            lines = handle.read().splitlines()
    except OSError:
        return []
    files = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # the unified (v2) hierarchy
            mount, name = CGROUP_ROOT, "memory.max"
        elif "memory" in controllers.split(","):
            mount, name = os.path.join(CGROUP_ROOT, controllers), "memory.limit_in_bytes"
        else:
            continue
        parts = [part for part in path.split("/") if part]
        files += [os.path.join(mount, *parts[:depth], name) for depth in range(len(parts), -1, -1)]
    return files


def _cgroup_limit(path: str) -> int | None:
    """A cgroup memory limit file's bytes; None where it is absent or says "max" (no limit). v1's
    "no limit" is a huge number, which the physical memory undercuts."""
    try:
        with open(path) as handle:
            text = handle.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def check_memory(needed_bytes: float, what: str, remedy: str) -> None:
    """Refuse, before allocating, what would hold more than half of the memory this process may use (the
    machine's, or its cgroup's limit if smaller: `memory_limit`), so that it is refused by name instead
    of killed: "{what} about N GiB in memory, more than half of this machine's M GiB: {remedy}"."""
    memory = memory_limit()
    if needed_bytes > memory.size / 2:
        raise InputError(
            f"{what} about {size_text(needed_bytes)} in memory, more than half of {memory.named()}: {remedy}"
        )


FULL_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def full_disk_reason(error: BaseException) -> str | None:
    """The system's message for a full file system ("No space left on device") or a spent quota ("Disk
    quota exceeded") where `error`, or an error it was raised from or while handling, is one: by the
    errno of an OSError where one carries it, else by that message in an error's text (a Beam runner
    relays a worker's error as text, TensorFlow raises errors of its own without an errno); None
    otherwise."""
    chain: list[BaseException] = []
    pending: list[BaseException | None] = [error]
    while pending:
        current = pending.pop()
        if current is not None and all(current is not seen for seen in chain):
            chain.append(current)
            pending += [current.__cause__, current.__context__]
    for current in chain:
        if isinstance(current, OSError) and current.errno in FULL_DISK_ERRNOS:
            return os.strerror(current.errno)
    texts = [str(current) for current in chain]
    return next(
        (os.strerror(code) for code in FULL_DISK_ERRNOS if any(os.strerror(code) in text for text in texts)), None
    )
