"""The output lock: a writer holds OUTPUT/.madp.lock while it writes OUTPUT (`exclusive`), so that a second writer
is refused instead of mixing its files with the first's, and a reader marks a folder while it reads it
(`reading`), so that a writer of another process is refused instead of changing the files under it. A lock
names its holder (`LockHolder`); one left by a killed process on this host is taken over, and on remote
storage a writer takes the lock by a claim of its own. The files it reads and writes are `madp.core.storage`'s."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import posixpath
import random
import socket
import threading
import time
import uuid
from typing import Any

from madp.core import storage
from madp.core.errors import InputError
from madp.core.storage import LOCK_FILE

log = logging.getLogger("madp.storage")

CLAIM_PREFIX = LOCK_FILE + ".claim-"  # a remote writer's claim to the lock (`_take_remote`)
READER_PREFIX = LOCK_FILE + ".reader-"  # a reader's mark (`reading`): writers are refused while it is there


class OutputLocked(InputError):
    """Another process is writing the output directory (or it cannot be written at all)."""


@dataclasses.dataclass(frozen=True)
class LockHolder:
    """The process a lock or a reader's mark names (`_holder_text`), each value as the file has it: None
    where the file lacks it (a damaged or foreign file, or none that could be read)."""

    pid: Any = None  # its process id
    host: Any = None  # the host it runs on
    thread: Any = None  # the thread that holds the lock
    command: Any = None  # what it runs
    since: Any = None  # when it took the lock
    keeps_content: Any = None  # a truthy value: it changes nothing readers read
    described: bool = False  # whether the file names pid, host, command and since (a message says them)

    @classmethod
    def from_json(cls, data: object) -> LockHolder:
        """The holder a lock file's JSON names; no one where it is not an object."""
        if not isinstance(data, dict):
            return cls()
        return cls(
            pid=data.get("pid"),
            host=data.get("host"),
            thread=data.get("thread"),
            command=data.get("command"),
            since=data.get("since"),
            keeps_content=data.get("keeps_content"),
            described=all(key in data for key in ("pid", "host", "command", "since")),
        )


def _holder_text(command: str, **fields: object) -> str:
    """What a lock or a reader's mark says of its process: a message names it, `_stale` checks it."""
    return json.dumps(
        {
            "pid": os.getpid(),
            "thread": threading.get_ident(),
            "host": socket.gethostname(),
            "command": command,
            "since": time.strftime("%Y-%m-%dT%H:%M:%S"),
            **fields,
        }
    )


@contextlib.contextmanager
def exclusive(output: str, command: str, keeps_content: bool = False):
    """Hold OUTPUT/.madp.lock while `command` writes OUTPUT, so that a second writer is refused
    instead of mixing its files with ours; an OUTPUT inside a directory another process holds (a stage
    folder of a running `madp run`) is refused too, and so is one that a reader of another process is
    reading (`reading`: a training on batches). `keeps_content`: the holder changes nothing that readers
    read (the trainings ledger of batches, which no reader's data includes), so readers go on meanwhile.
    Local directories lock atomically, the lock created whole with its holder (`_create_whole`); a lock
    left by a killed process on this host is taken over. On remote storage (gs://, s3://, hdfs://) a writer takes
    it by a claim of its own (`_take_remote`), so that of two writers started at the same instant at most
    one passes; a lock or claim left there by a killed process is removed by hand (the error names it).
    A local OUTPUT folder that taking the lock created and the command left empty (it failed before
    writing: an input refused, a bad option) is removed with the lock."""
    if storage.kind(output) == "file":
        raise OutputLocked(f"{output} is a file; the output must be a directory")
    lock = storage.join(output, LOCK_FILE)
    holder = _holder_text(command, **({"keeps_content": True} if keeps_content else {}))
    try:
        _refuse_enclosing_writer(output)
        claim, created = None, False
        if "://" in output:
            claim = _take_remote(output, lock, holder)
        else:
            created = not os.path.exists(output)
            _take_local(output, lock, holder)
    except PermissionError as error:
        raise OutputLocked(f"cannot write {output}: {error.strerror or error}") from error
    try:
        if not keeps_content:  # after taking the lock: a reader that marked before we took it is seen here
            _refuse_readers(output)
        yield
    finally:
        storage.remove_file(lock)
        if claim is not None:
            storage.remove_file(claim)  # after the lock: a crash between them leaves the output refused, not open
        if created:
            with contextlib.suppress(OSError):  # not empty: the command wrote there
                os.rmdir(output)


@contextlib.contextmanager
def reading(directory: str, reader: str):
    """Hold a reader's mark (DIRECTORY/.madp.lock.reader-<random>) while `reader` reads DIRECTORY, so that
    a writer of another process (`exclusive`: `madp batch` rewriting the batches) is refused instead of
    changing the files under it; a DIRECTORY that another process holds to write it is refused. The
    reader marks before it looks for the lock and the writer takes the lock before it looks for marks, so
    of the two at least one sees the other. Readers never refuse each other, and a process never refuses
    itself (a training holds its batches' lock to write their ledger while it reads them). Where the mark
    cannot be written (read-only storage) the reader goes on, with a warning, after the lock's check."""
    if storage.kind(directory) != "directory":  # nothing to read: the reader's own error says so
        yield
        return
    mark, marked = storage.join(directory, f"{READER_PREFIX}{uuid.uuid4().hex}"), True
    try:
        storage.write_text(mark, _holder_text(reader))
    except InputError as error:
        log.warning("%s: a writer started meanwhile would not be refused (%s)", directory, error)
        marked = False
    try:
        lock = storage.join(directory, LOCK_FILE)
        if storage.kind(lock) == "file" and not _stale(lock) and not _ours(lock) and not _holder(lock).keeps_content:
            raise OutputLocked(_held(lock))
        yield
    finally:
        if marked:
            storage.remove_file(mark)


def _refuse_readers(output: str) -> None:
    """Refuse a writer of OUTPUT while a live reader of another process marks it (`reading`); a mark left
    by a killed process on this host is removed."""
    for mark in _listed(output, READER_PREFIX):
        if _stale(mark):
            storage.remove_file(mark)
        elif not _ours(mark):
            raise OutputLocked(
                f"{output} is being read by another madp process ({_holder_of(mark, '')}); wait for it, or if "
                f"none is running remove {mark}"
            )


def _enclosing_locks(output: str) -> list[str]:
    """The lock files of the directories above OUTPUT (a `madp run` holds its run_dir's). A local OUTPUT's
    are those above it as given and above where its links lead: a link inside a running `madp run`'s
    run_dir, and a link elsewhere to one of its stage folders, both find that run's lock."""
    if "://" in output:
        scheme, rest = output.split("://", 1)
        parts = rest.rstrip("/").split("/")
        return [f"{scheme}://{'/'.join(parts[:i])}/{LOCK_FILE}" for i in range(len(parts) - 1, 0, -1)]
    locks: dict[str, None] = {}  # in order, once each
    for directory in (os.path.abspath(output), os.path.realpath(output)):
        while (parent := os.path.dirname(directory)) != directory:
            directory = parent
            locks[os.path.join(directory, LOCK_FILE)] = None
    return list(locks)


def _refuse_enclosing_writer(output: str) -> None:
    """OUTPUT inside a directory that another live madp process holds (a stage folder of a running
    `madp run`) is that process's to write: a second writer would change what it trains on."""
    for lock in _enclosing_locks(output):
        if storage.kind(lock) != "file" or _stale(lock):
            continue
        if not _ours(lock):
            raise OutputLocked(_held(lock))


def holds(output: str) -> bool:
    """Whether this thread holds OUTPUT's lock (runs inside `exclusive(OUTPUT, ...)`): another thread of
    the process does not, so that two threads never both write what the lock guards."""
    lock = storage.join(output, LOCK_FILE)
    return storage.kind(lock) == "file" and _ours(lock) and _holder(lock).thread == threading.get_ident()


def _ours(lock: str) -> bool:
    holder = _holder(lock)
    return holder.pid == os.getpid() and holder.host == socket.gethostname()


def _holder(lock: str) -> LockHolder:
    """Who `lock` (or a reader's mark) names; no one where it cannot be read or is not JSON."""
    try:
        return LockHolder.from_json(json.loads(storage.read_text(lock)))
    except (OSError, ValueError):
        return LockHolder()


def _take_remote(output: str, lock: str, holder: str) -> str:
    """Take a remote OUTPUT's lock; the claim to remove at release. pyarrow's object-store filesystems
    have no create-if-absent, so a writer writes a claim of its own (LOCK_FILE.claim-<random>), then
    lists the claims, and holds the lock only if its claim is the only one; else it withdraws it. Two
    writers cannot both pass where writes and listings are strongly consistent (GCS, S3 since 2020,
    HDFS): each wrote its claim before it listed, so whichever listed last saw the other's. Writers that
    see each other all withdraw, wait a random while (doubling) and try again, _CLAIM_TRIES times in
    all. The claim stays until release, so a later writer is refused even before LOCK_FILE (the holder,
    for messages and `holds`) is written. Claims are told apart by name: pyarrow lists hdfs:// paths
    without their host."""
    holders: dict[str, str] = {}  # other claims by name: their holders, read before withdrawing
    tries: dict[str, int] = {}  # on how many tries each was seen
    for attempt in range(_CLAIM_TRIES):
        if storage.kind(lock) == "file":
            raise OutputLocked(_held(lock) + f" (and its claim {CLAIM_PREFIX}*)")
        name = f"{CLAIM_PREFIX}{uuid.uuid4().hex}"
        claim = storage.join(output, name)
        try:
            storage.write_text(claim, holder)
            claims = _listed(output, CLAIM_PREFIX)
            others = [posixpath.basename(path) for path in claims if posixpath.basename(path) != name]
            if not others:
                storage.write_text(lock, holder)
                return claim
            for other in others:
                holders.setdefault(other, _holder_of(storage.join(output, other)))
                tries[other] = tries.get(other, 0) + 1
            storage.remove_file(claim)
        except BaseException as error:  # a claim left behind would refuse every later writer
            with contextlib.suppress(OSError, InputError):
                storage.remove_file(claim)
            if isinstance(error, OSError):
                raise OutputLocked(f"cannot take the lock of {output}: {error}") from error
            raise
        if attempt + 1 < _CLAIM_TRIES:
            time.sleep(random.uniform(0.2, 1.0) * 2**attempt)
    lasting = [other for other in others if tries[other] == _CLAIM_TRIES]
    named = "; ".join(f"{storage.join(output, other)} ({holders[other]})" for other in lasting or others)
    if lasting:
        raise OutputLocked(
            f"{output} is claimed by another madp process through {_CLAIM_TRIES} tries: {named}. Wait for it, "
            f"or if none is running (a killed process left its claim) remove it"
        )
    raise OutputLocked(
        f"other madp processes were taking the lock of {output} at the same time as this one, on each of "
        f"{_CLAIM_TRIES} tries ({named}): start again"
    )


_CLAIM_TRIES = 5  # waits of 0.2-1 s, doubling: at most 15 s in all


def _listed(output: str, prefix: str) -> list[str]:
    """The files directly in OUTPUT whose names start with `prefix` (writers' claims, readers' marks)."""
    try:
        listed = storage.list_files(output, recursive=False)
    except (OSError, InputError) as error:
        raise OutputLocked(f"cannot list {output} to take its lock: {error}") from error
    return [path for path in listed if posixpath.basename(path).startswith(prefix)]


def _take_local(output: str, lock: str, holder: str) -> None:
    for _ in range(3):
        os.makedirs(output, exist_ok=True)
        try:
            _create_whole(lock, holder)
        except FileNotFoundError:  # a writer that had made OUTPUT removed it, empty, on leaving: make it again
            continue
        except FileExistsError:
            if not _stale(lock):
                raise OutputLocked(_held(lock)) from None
            os.remove(lock)  # its process died (a killed run): the output is ours to redo
            continue
        return
    raise OutputLocked(_held(lock))


def _create_whole(path: str, text: str) -> None:
    """Create the local file `path` holding `text`, or raise FileExistsError where it exists, so that a lock
    file always names its holder: `text` is written to a file of its own, which is then linked to `path` (a
    link fails where the name exists). A write that fails (a full disk: a `DiskFull` naming `path`) leaves
    no file."""
    written = f"{path}.{uuid.uuid4().hex}{storage.TEMPORARY_SUFFIX}"
    try:
        _write_new(written, text)
        try:
            os.link(written, path)
        except OSError as error:
            if error.errno not in _NO_HARD_LINKS:
                raise
            _write_new(path, text)  # a file system without hard links: created exclusively, then written
    except OSError as error:
        full = storage.disk_full(path, error)
        if full is None:
            raise
        raise full from error
    finally:
        with contextlib.suppress(OSError):
            os.remove(written)


_NO_HARD_LINKS = (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP)  # what os.link raises where links are unsupported


def _write_new(path: str, text: str) -> None:
    """Create `path` (FileExistsError where it exists) holding `text`; a write that fails removes it."""
    with open(path, "x", encoding="utf-8") as handle:
        try:
            handle.write(text)
            handle.flush()
        except BaseException:
            os.remove(path)
            raise


def _stale(lock: str) -> bool:
    """Whether a local lock's process is gone (same host, no such pid)."""
    holder = _holder(lock)
    if holder.host != socket.gethostname():
        return False
    try:
        os.kill(int(holder.pid), 0)
    except ProcessLookupError:
        return True
    except (OSError, ValueError, TypeError):  # a pid of no process we may signal, or none
        return False
    return False


def _held(lock: str) -> str:
    return (
        f"{posixpath.dirname(lock) or '.'} is being written by another madp process ({_holder_of(lock)}); wait "
        f"for it, or if none is running remove {lock}"
    )


def _holder_of(lock: str, program: str = "madp ") -> str:
    holder = _holder(lock)
    if not holder.described:
        return "an unknown process"
    return f"pid {holder.pid} on {holder.host}, `{program}{holder.command}`, since {holder.since}"
