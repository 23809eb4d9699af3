"""Files on local disk or any filesystem pyarrow knows (gs://, s3://, hdfs://), by path or URI."""

from __future__ import annotations

import contextlib
import hashlib
import os
import posixpath
import shutil
import uuid
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from madp.core.errors import DiskFull, InputError, full_disk_reason, size_text


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


TEMPORARY_SUFFIX = ".tmp"  # of write_whole's hidden temporaries, .NAME.<random>.tmp, and the output lock's


def _is_temporary(name: str) -> bool:
    return name.startswith(".") and name.endswith(TEMPORARY_SUFFIX)


def write_whole(path: str, write: Callable[[Any], object]) -> None:
    """Write `path` under a hidden temporary name beside it, then rename it into place, so that a full
    disk or a killed process never leaves a truncated file (a 0-byte report.json) for a consumer to
    take for a finished output. An OSError is an InputError naming the output (a `DiskFull` on a full
    file system); the temporary is removed, on an interruption (Ctrl-C) too."""
    directory, name = (posixpath if "://" in path else os.path).split(path)
    temporary = join(directory, f".{name}.{uuid.uuid4().hex}{TEMPORARY_SUFFIX}")
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


# The output lock's file (`madp.core.output_lock`): it, its claims and its readers' marks (names that start with
# it) are no content of the folder they lie in.
LOCK_FILE = ".madp.lock"


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


def move_file(source: str, target: str) -> None:
    """Put the file `source` in place of `target`, replacing a file there: a rename on a local disk; a
    copy and a delete on an object store."""
    filesystem, origin = _resolve(source)
    destination = _resolve(target)[1]
    filesystem.create_dir(posixpath.dirname(destination), recursive=True)
    if "://" in source:  # not every object store's `move` moves a file
        filesystem.copy_file(origin, destination)
        filesystem.delete_file(origin)
    else:
        filesystem.move(origin, destination)


def move_below(source: str, target: str, relatives: list[str]) -> None:
    """Move the files at `relatives` (paths below folder `source`) to the same paths below folder `target`
    (`move_file`), then remove the folders below `source` this leaves empty."""
    filesystem, root = _resolve(source)
    for relative in relatives:
        move_file(join(source, relative), join(target, relative))
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
