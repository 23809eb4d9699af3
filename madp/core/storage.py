"""Files on local disk or any filesystem pyarrow knows (gs://, s3://, hdfs://), by path or URI."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import logging
import os
import posixpath
import random
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from madp.core.errors import DiskFull, InputError, full_disk_reason, size_text

log = logging.getLogger("madp.storage")


def _resolve(path: str) -> tuple[pafs.FileSystem, str]:
    if "://" in path:
        return pafs.FileSystem.from_uri(path)
    return pafs.LocalFileSystem(), os.path.abspath(path)


def join(base: str, *parts: str) -> str:
    return posixpath.join(base, *parts) if "://" in base else os.path.join(base, *parts)


def open_input(path: str):
    filesystem, resolved = _resolve(path)
    return filesystem.open_input_file(resolved)


def open_output(path: str):
    filesystem, resolved = _resolve(path)
    filesystem.create_dir(posixpath.dirname(resolved), recursive=True)
    return filesystem.open_output_stream(resolved)


def read_text(path: str) -> str:
    with open_input(path) as handle:
        return handle.read().decode("utf-8")


def sha256(path: str) -> str:
    """Hex SHA-256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open_input(path) as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_parquet(path: str, columns: list[str] | None = None) -> pa.Table:
    """A Parquet file's table, its page checksums verified: a truncated, empty or corrupted file is an
    error that names it, never different records."""
    if kind(path) == "directory":
        return pa.concat_tables([read_parquet(file, columns) for file in list_files(path) if file.endswith(".parquet")])
    try:
        with open_input(path) as handle:
            return pq.read_table(handle, columns=columns, page_checksum_verification=True)
    except (pa.ArrowInvalid, OSError) as error:
        raise InputError(f"{path}: not a readable Parquet file ({error})") from error


def parquet_columns(path: str) -> list[str]:
    try:
        with open_input(path) as handle:
            return pq.read_schema(handle).names
    except (pa.ArrowInvalid, OSError) as error:
        raise InputError(f"{path}: not a readable Parquet file ({error})") from error


def write_parquet(table: pa.Table, path: str) -> None:
    """Write with page checksums, so that bit rot in an intermediate file is caught when it is read;
    whole or not at all (`write_whole`)."""
    write_whole(path, lambda handle: parquet_to(handle, table))


def parquet_to(handle, table: pa.Table) -> None:
    """`table` as Parquet with page checksums into an open binary handle."""
    pq.write_table(table, handle, write_page_checksum=True)


def manifest(paths: list[str]) -> list[dict]:
    """Name, size and SHA-256 of each file: what an output's report lists, so that consumers read
    exactly the files the producer wrote and notice any change."""
    return [{"name": posixpath.basename(path), "bytes": size(path), "sha256": sha256(path)} for path in paths]


def size(path: str) -> int:
    filesystem, resolved = _resolve(path)
    return filesystem.get_file_info(resolved).size


def write_text(path: str, text: str) -> None:
    """Write a text file (a report, rejects, a schema) whole or not at all (`write_whole`)."""
    write_whole(path, lambda handle: handle.write(text.encode("utf-8")))


_TEMPORARY_SUFFIX = ".tmp"  # of write_whole's hidden temporaries, .NAME.<random>.tmp


def _is_temporary(name: str) -> bool:
    return name.startswith(".") and name.endswith(_TEMPORARY_SUFFIX)


def write_whole(path: str, write: Callable[[Any], object]) -> None:
    """Write `path` under a hidden temporary name beside it, then rename it into place, so that a full
    disk or a killed process never leaves a truncated file (a 0-byte report.json) for a consumer to
    take for a finished output. An OSError is an InputError naming the output (a `DiskFull` on a full
    file system); the temporary is removed, on an interruption (Ctrl-C) too."""
    directory, name = (posixpath if "://" in path else os.path).split(path)
    temporary = join(directory, f".{name}.{uuid.uuid4().hex}{_TEMPORARY_SUFFIX}")
    filesystem, resolved = _resolve(path)
    try:
        with open_output(temporary) as handle:
            write(handle)
        filesystem.move(_resolve(temporary)[1], resolved)
    except BaseException as error:
        with contextlib.suppress(OSError):
            filesystem.delete_file(_resolve(temporary)[1])
        if not isinstance(error, OSError):
            raise
        full = disk_full(path, error)
        if full is not None:
            raise full from error
        raise InputError(f"cannot write {path}: {error.strerror or error}") from error


def disk_full(path: str | None, error: BaseException) -> DiskFull | None:
    """The error to report for `error` met writing `path` (a file, or the directory written into; None
    where unknown) when it is a full file system or a spent quota (`errors.full_disk_reason`): it names
    the path, what its file system has free (local paths), and what to do; None for any other error."""
    reason = full_disk_reason(error)
    if reason is None:
        return None
    if path is None:
        return DiskFull(f"a write failed: {reason}: free space, or write to another file system")
    return DiskFull(
        f"cannot write {path}: {reason}{_free_space(path)}: free space there, or write to another file system"
    )


def _free_space(path: str) -> str:
    """What the file system of a local path (of its nearest existing directory) has free, for a message;
    "" for a remote one."""
    if "://" in path:
        return ""
    directory = os.path.abspath(path)
    while not os.path.isdir(directory) and os.path.dirname(directory) != directory:
        directory = os.path.dirname(directory)
    try:
        usage = shutil.disk_usage(directory)
    except OSError:
        return ""
    return f" (its file system has {size_text(usage.free)} free of {size_text(usage.total)})"


def kind(path: str) -> str:
    """'file', 'directory' or 'missing'."""
    filesystem, resolved = _resolve(path)
    info = filesystem.get_file_info(resolved)
    return {pafs.FileType.File: "file", pafs.FileType.Directory: "directory"}.get(info.type, "missing")


HIDDEN = (".", "_")  # names an input directory's listing skips: `.ipynb_checkpoints/`, Spark's `_temporary/`


def list_files(directory: str, recursive: bool = True, skip_hidden: bool = False) -> list[str]:
    """Every file below (or, not recursive, directly in) a directory, sorted, as paths or URIs like the
    directory's. With `skip_hidden`, none whose name, or the name of a directory between it and
    `directory`, starts with '.' or '_'. Local links are followed; one back to a directory above it
    (a loop) is an InputError naming it, never an endless walk."""
    if "://" not in directory:
        return _local_files(os.path.abspath(directory), recursive, skip_hidden)
    filesystem, resolved = _resolve(directory)
    infos = filesystem.get_file_info(pafs.FileSelector(resolved, recursive=recursive))
    prefix = directory.split("://")[0] + "://"
    return sorted(
        prefix + info.path
        for info in infos
        if info.type == pafs.FileType.File and not (skip_hidden and _hidden(posixpath.relpath(info.path, resolved)))
    )


def _hidden(relative: str) -> bool:
    return any(part.startswith(HIDDEN) for part in relative.split("/"))


def _local_files(root: str, recursive: bool, skip_hidden: bool) -> list[str]:
    files = []
    try:
        pending = [(root, frozenset({_identity(root)}))]
        while pending:
            directory, above = pending.pop()
            for entry in list(os.scandir(directory)):
                if skip_hidden and entry.name.startswith(HIDDEN):
                    continue
                if entry.is_dir():
                    if not recursive:
                        continue
                    identity = _identity(entry.path)
                    if identity in above:
                        raise InputError(
                            f"{entry.path}: a link to {os.path.realpath(entry.path)}, a directory holding it "
                            f"(a loop): remove the link"
                        )
                    pending.append((entry.path, above | {identity}))
                elif entry.is_file():
                    files.append(entry.path)
    except OSError as error:
        raise InputError(f"{error.filename or root}: cannot be listed ({error.strerror or error})") from error
    return sorted(files)


def _identity(directory: str) -> tuple[int, int]:
    status = os.stat(directory)
    return status.st_dev, status.st_ino


def content_digest(path: str, ignore: tuple[str, ...] = (), skip_hidden: bool = False) -> str:
    """SHA-256 over the names (relative to `path`) and contents of a file or of every file below a
    directory, lock files and files named in `ignore` left out (and with `skip_hidden`, hidden ones as
    `list_files` says): what a reader of `path` would read, whatever the files' times say."""
    found = kind(path)
    files = list_files(path, skip_hidden=skip_hidden) if found == "directory" else [path] if found == "file" else []
    root = path.rstrip("/") if "://" in path else os.path.abspath(path)
    digest = hashlib.sha256()
    for name in files:
        base = posixpath.basename(name)
        # the lock, its claims and readers' marks, and write_whole's temporaries: not what a reader reads
        written = base.startswith(LOCK_FILE) or _is_temporary(base)
        if base not in ignore and not written:
            relative = posixpath.relpath(name, root) if found == "directory" else ""
            digest.update(f"{relative}\0{sha256(name)}\n".encode())
    return digest.hexdigest()


def clear_directory(directory: str) -> None:
    filesystem, resolved = _resolve(directory)
    if filesystem.get_file_info(resolved).type == pafs.FileType.Directory:
        filesystem.delete_dir_contents(resolved)


def below(directory: str, path: str) -> str:
    """The path below `directory` of a file `list_files(directory)` listed."""
    if "://" in directory:
        return posixpath.relpath(path, directory.rstrip("/"))
    return posixpath.relpath(os.path.abspath(path), os.path.abspath(directory))


def written_files(output: str, writes: Callable[[str], bool], command: str) -> list[str]:
    """The files an earlier run of `command` left in OUTPUT, which this one may replace: those whose path
    below OUTPUT `writes` says it writes. Any other file there (hidden names aside: no madp input reads
    them, and the lock's are among them) was not madp's to delete: an InputError names it, before anything
    is written or deleted."""
    if kind(output) != "directory":
        return []
    own: list[str] = []
    foreign: list[str] = []
    for path in list_files(output, skip_hidden=True):
        (own if writes(below(output, path)) else foreign).append(path)
    if foreign:
        named = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise InputError(
            f"{output} holds files {command} did not write ({named}): madp replaces only its own outputs and "
            f"never deletes yours; move them, or write to another OUTPUT"
        )
    return own


def remove_written(output: str, paths: list[str]) -> None:
    """Delete `paths` (files below OUTPUT, from `written_files`), then the folders between them and OUTPUT
    that this leaves empty."""
    filesystem, root = _resolve(output)
    for path in paths:
        filesystem.delete_file(_resolve(path)[1])
    _remove_emptied_folders(filesystem, root, paths)


def move_below(source: str, target: str, relatives: list[str]) -> None:
    """Move the files at `relatives` (paths below folder `source`) to the same paths below folder `target`,
    replacing a file there, then remove the folders below `source` this leaves empty. A rename on a local
    disk; a copy and a delete on an object store."""
    filesystem, root = _resolve(source)
    for relative in relatives:
        origin, destination = _resolve(join(source, relative))[1], _resolve(join(target, relative))[1]
        filesystem.create_dir(posixpath.dirname(destination), recursive=True)
        if "://" in source:  # not every object store's `move` moves a file
            filesystem.copy_file(origin, destination)
            filesystem.delete_file(origin)
        else:
            filesystem.move(origin, destination)
    _remove_emptied_folders(filesystem, root, [join(source, relative) for relative in relatives])


def remove_tree(directory: str) -> None:
    """Delete a folder and everything below it (nothing where it is missing)."""
    filesystem, resolved = _resolve(directory)
    if filesystem.get_file_info(resolved).type == pafs.FileType.Directory:
        filesystem.delete_dir(resolved)


def _remove_emptied_folders(filesystem: pafs.FileSystem, root: str, removed: list[str]) -> None:
    """Remove the folders between the files `removed` (gone now) and `root` that are left empty."""
    folders = set()
    for path in removed:
        folder = posixpath.dirname(_resolve(path)[1])
        while folder.startswith(root + "/"):
            folders.add(folder)
            folder = posixpath.dirname(folder)
    for folder in sorted(folders, key=len, reverse=True):  # the deepest first
        listed = filesystem.get_file_info(pafs.FileSelector(folder, allow_not_found=True))
        if not listed and filesystem.get_file_info(folder).type == pafs.FileType.Directory:
            filesystem.delete_dir(folder)


def link_or_copy(source: str, target: str) -> None:
    """Make `target` read as `source`: a symbolic link on local disks, a copy on object stores (no links)."""
    if "://" not in source and "://" not in target:
        os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
        os.symlink(os.path.abspath(source), target)
        return
    with open_input(source) as reader, open_output(target) as writer:
        while block := reader.read(1 << 24):
            writer.write(block)


def remove_file(path: str) -> None:
    filesystem, resolved = _resolve(path)
    if filesystem.get_file_info(resolved).type == pafs.FileType.File:
        filesystem.delete_file(resolved)


LOCK_FILE = ".madp.lock"
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
    one passes; a lock or claim left there by a killed process is removed by hand (the error names it)."""
    if kind(output) == "file":
        raise OutputLocked(f"{output} is a file; the output must be a directory")
    lock = join(output, LOCK_FILE)
    holder = _holder_text(command, **({"keeps_content": True} if keeps_content else {}))
    try:
        _refuse_enclosing_writer(output)
        claim = None
        if "://" in output:
            claim = _take_remote(output, lock, holder)
        else:
            _take_local(output, lock, holder)
    except PermissionError as error:
        raise OutputLocked(f"cannot write {output}: {error.strerror or error}") from error
    try:
        if not keeps_content:  # after taking the lock: a reader that marked before we took it is seen here
            _refuse_readers(output)
        yield
    finally:
        remove_file(lock)
        if claim is not None:
            remove_file(claim)  # after the lock: a crash between them leaves the output refused, not open


@contextlib.contextmanager
def reading(directory: str, reader: str):
    """Hold a reader's mark (DIRECTORY/.madp.lock.reader-<random>) while `reader` reads DIRECTORY, so that
    a writer of another process (`exclusive`: `madp batch` rewriting the batches) is refused instead of
    changing the files under it; a DIRECTORY that another process holds to write it is refused. The
    reader marks before it looks for the lock and the writer takes the lock before it looks for marks, so
    of the two at least one sees the other. Readers never refuse each other, and a process never refuses
    itself (a training holds its batches' lock to write their ledger while it reads them). Where the mark
    cannot be written (read-only storage) the reader goes on, with a warning, after the lock's check."""
    if kind(directory) != "directory":  # nothing to read: the reader's own error says so
        yield
        return
    mark, marked = join(directory, f"{READER_PREFIX}{uuid.uuid4().hex}"), True
    try:
        write_text(mark, _holder_text(reader))
    except InputError as error:
        log.warning("%s: a writer started meanwhile would not be refused (%s)", directory, error)
        marked = False
    try:
        lock = join(directory, LOCK_FILE)
        if kind(lock) == "file" and not _stale(lock) and not _ours(lock) and not _holder(lock).keeps_content:
            raise OutputLocked(_held(lock))
        yield
    finally:
        if marked:
            remove_file(mark)


def _refuse_readers(output: str) -> None:
    """Refuse a writer of OUTPUT while a live reader of another process marks it (`reading`); a mark left
    by a killed process on this host is removed."""
    for mark in _listed(output, READER_PREFIX):
        if _stale(mark):
            remove_file(mark)
        elif not _ours(mark):
            raise OutputLocked(
                f"{output} is being read by another madp process ({_holder_of(mark, '')}); wait for it, or if "
                f"none is running remove {mark}"
            )


def _absolute(path: str) -> str:
    """A path for comparing places: local paths resolved (links followed), URIs as written, no trailing /."""
    return path.rstrip("/") if "://" in path else os.path.realpath(path)


def _within(inner: str, outer: str) -> bool:
    return inner == outer or inner.startswith(outer + "/")


def overlaps(first: str, second: str) -> bool:
    """Whether one path is, or lies inside, the other (links followed)."""
    first, second = _absolute(first), _absolute(second)
    return _within(first, second) or _within(second, first)


def refuse_overlap(output: str, inputs: list[str]) -> None:
    """A command replaces what it writes in OUTPUT: an OUTPUT that is, contains or lies inside one of its
    inputs could delete the user's files or read its own outputs back as input."""
    for path in inputs:
        if overlaps(output, path):
            raise InputError(
                f"output {output} overlaps input {path} (one is, or lies inside, the other): "
                f"write the output to a directory of its own"
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
        if kind(lock) != "file" or _stale(lock):
            continue
        if not _ours(lock):
            raise OutputLocked(_held(lock))


def holds(output: str) -> bool:
    """Whether this thread holds OUTPUT's lock (runs inside `exclusive(OUTPUT, ...)`): another thread of
    the process does not, so that two threads never both write what the lock guards."""
    lock = join(output, LOCK_FILE)
    return kind(lock) == "file" and _ours(lock) and _holder(lock).thread == threading.get_ident()


def _ours(lock: str) -> bool:
    holder = _holder(lock)
    return holder.pid == os.getpid() and holder.host == socket.gethostname()


def _holder(lock: str) -> LockHolder:
    """Who `lock` (or a reader's mark) names; no one where it cannot be read or is not JSON."""
    try:
        return LockHolder.from_json(json.loads(read_text(lock)))
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
        if kind(lock) == "file":
            raise OutputLocked(_held(lock) + f" (and its claim {CLAIM_PREFIX}*)")
        name = f"{CLAIM_PREFIX}{uuid.uuid4().hex}"
        claim = join(output, name)
        try:
            write_text(claim, holder)
            claims = _listed(output, CLAIM_PREFIX)
            others = [posixpath.basename(path) for path in claims if posixpath.basename(path) != name]
            if not others:
                write_text(lock, holder)
                return claim
            for other in others:
                holders.setdefault(other, _holder_of(join(output, other)))
                tries[other] = tries.get(other, 0) + 1
            remove_file(claim)
        except BaseException as error:  # a claim left behind would refuse every later writer
            with contextlib.suppress(OSError, InputError):
                remove_file(claim)
            if isinstance(error, OSError):
                raise OutputLocked(f"cannot take the lock of {output}: {error}") from error
            raise
        if attempt + 1 < _CLAIM_TRIES:
            time.sleep(random.uniform(0.2, 1.0) * 2**attempt)
    lasting = [other for other in others if tries[other] == _CLAIM_TRIES]
    named = "; ".join(f"{join(output, other)} ({holders[other]})" for other in lasting or others)
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
        listed = list_files(output, recursive=False)
    except (OSError, InputError) as error:
        raise OutputLocked(f"cannot list {output} to take its lock: {error}") from error
    return [path for path in listed if posixpath.basename(path).startswith(prefix)]


def _take_local(output: str, lock: str, holder: str) -> None:
    os.makedirs(output, exist_ok=True)
    for _ in range(2):
        try:
            _create_whole(lock, holder)
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
    written = f"{path}.{uuid.uuid4().hex}{_TEMPORARY_SUFFIX}"
    try:
        _write_new(written, text)
        try:
            os.link(written, path)
        except OSError as error:
            if error.errno not in _NO_HARD_LINKS:
                raise
            _write_new(path, text)  # a file system without hard links: created exclusively, then written
    except OSError as error:
        full = disk_full(path, error)
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
