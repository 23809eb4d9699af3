"""The hand-off of batches to a trainer: a `madp batch` output at a URL that TensorFlow cannot read
(TensorFlow 2.21 has no gs://, s3:// or hdfs:// file system) copied into a local folder first, through
Beam's `FileSystems`, which have those file systems with Beam's extras (`apache-beam[gcp]`, `[aws]`,
`[hadoop]`). Each file the batch report lists is checked against its size and SHA-256 as it arrives, so
a training never starts on a file that differs from the one `madp batch` wrote.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import posixpath
from collections.abc import Sequence

from apache_beam.io.filesystem import BeamIOError, CompressionTypes, FileSystem
from apache_beam.io.filesystems import FileSystems

from madp.beam.pipeline import pipeline_options
from madp.core import storage
from madp.core.batch_files import SCHEMA_FILE, TRAININGS_FILE
from madp.core.errors import InputError
from madp.core.progress import Progress
from madp.core.reports import BatchReport, FileEntry
from madp.core.selection import REPORT_FILE

log = logging.getLogger("madp.train")

# The client library each of Beam's file systems imports when first used, and Beam's extra that installs it
# (apache-beam[EXTRA]): Beam registers the file systems without them, and fails only at the first access
CLIENTS = {
    "gs": ("google.cloud.storage", "gcp"),
    "s3": ("boto3", "aws"),
    "hdfs": ("hdfs", "hadoop"),
    "azfs": ("azure.storage.blob", "azure"),
}
_BLOCK = 1 << 22  # bytes read and written at a time


def default_copy_folder(url: str) -> str:
    """Where the batches at `url` are copied unless the training names a folder (`--batches-copy`): one
    folder per URL in the user's cache ($XDG_CACHE_HOME/madp/batches or ~/.cache/madp/batches), so that a
    second training on the same batches copies only what changed."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "madp", "batches", hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16])


def copy_batches(url: str, folder: str, file_system_options: Sequence[str] = ()) -> str:
    """Copy the `madp batch` output at `url` into the local `folder` and return the folder: its report,
    schema and batch files (and its own trainings ledger, where an earlier madp kept one there), each
    batch file checked against the size and SHA-256 the report lists. A file the folder already holds
    with those is kept; batch files the report does not list are removed, so that the folder is the
    output as `madp batch` wrote it. `file_system_options`: Beam pipeline options of the file systems
    (`--hdfs_host`, `--s3_region_name`, ...)."""
    _file_system(url, file_system_options)
    try:
        return _copy(url, folder)
    except InputError:
        raise
    except (BeamIOError, ValueError) as error:  # Beam's: a file system that cannot reach or read the URL
        raise InputError(f"{url}: the batches cannot be copied for the training: {error}") from error


def _copy(url: str, folder: str) -> str:
    report_url = FileSystems.join(url, REPORT_FILE)
    report_bytes = _read(report_url, f"{url}: not a finished `madp batch` output (no readable {REPORT_FILE})")
    try:
        data = json.loads(report_bytes)
    except ValueError as error:  # not JSON, or not UTF-8
        raise InputError(f"{report_url} is not a madp batch report (not JSON: {error}); re-run madp batch") from None
    report = BatchReport.from_json(data, report_url)
    os.makedirs(folder, exist_ok=True)
    listed = {entry.name for entry in report.files}
    for name in os.listdir(folder):  # a copy of earlier batches at this URL: only the listed ones stay
        if name.startswith("batches-") and name.endswith(".tfrecord") and name not in listed:
            os.remove(os.path.join(folder, name))
    total = sum(entry.bytes for entry in report.files)
    progress = Progress(log, f"copying the batches {url} to {folder}", total >> 20, "MiB")
    copied = 0
    for entry in report.files:
        _copy_file(FileSystems.join(url, entry.name), os.path.join(folder, entry.name), entry)
        copied += entry.bytes
        progress.update(copied >> 20)
    schema = _read(FileSystems.join(url, SCHEMA_FILE), f"{url}: not a finished `madp batch` output (no {SCHEMA_FILE})")
    storage.write_text(os.path.join(folder, SCHEMA_FILE), schema.decode("utf-8"))
    ledger, kept_ledger = FileSystems.join(url, TRAININGS_FILE), os.path.join(folder, TRAININGS_FILE)
    if FileSystems.exists(ledger):
        storage.write_text(kept_ledger, _read(ledger, ledger).decode("utf-8"))
    else:
        storage.remove_file(kept_ledger)
    storage.write_text(os.path.join(folder, REPORT_FILE), report_bytes.decode("utf-8"))  # last: the copy is whole
    log.info("copied the batches %s to %s (%d files, %d bytes)", url, folder, len(report.files), total)
    return folder


def _file_system(url: str, file_system_options: Sequence[str]) -> None:
    """Set up Beam's file systems with the options, and check that `url`'s has what it needs here: an error
    that names the URL and Beam's extra for its scheme where that is not installed."""
    FileSystems.set_options(pipeline_options(list(file_system_options)))
    scheme = FileSystems.get_scheme(url)
    module, extra = CLIENTS.get(str(scheme), (None, None))
    known = any(system.scheme() == scheme for system in FileSystem.get_all_subclasses())
    if not known or (module is not None and not _importable(module)):
        install = f"pip install 'apache-beam[{extra}]'" if extra else "install a Beam file system for it"
        raise InputError(
            f"{url}: Beam has no {scheme}:// file system in this environment, so the batches cannot be copied "
            f"for the training (TensorFlow reads no such URL): {install}"
        )


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


def _read(path: str, missing: str) -> bytes:
    if not FileSystems.exists(path):
        raise InputError(missing)
    with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as handle:
        return handle.read()


def _local_sha256(path: str) -> str | None:
    if not os.path.isfile(path):
        return None
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(_BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


def _copy_file(source: str, target: str, entry: FileEntry) -> None:
    """Copy one listed batch file, unless `target` already holds it; its size and SHA-256 checked before
    it takes its name (`storage.write_whole`), so that a differing file never lands in the folder."""
    if os.path.isfile(target) and os.path.getsize(target) == entry.bytes and _local_sha256(target) == entry.sha256:
        return
    if not FileSystems.exists(source):
        raise InputError(f"{source}: missing (its {REPORT_FILE} lists {entry.name}); re-run madp batch")

    def write(handle) -> None:
        digest, size = hashlib.sha256(), 0
        with FileSystems.open(source, compression_type=CompressionTypes.UNCOMPRESSED) as read:
            for block in iter(lambda: read.read(_BLOCK), b""):
                digest.update(block)
                size += len(block)
                handle.write(block)
        if (size, digest.hexdigest()) != (entry.bytes, entry.sha256):
            raise InputError(
                f"{source} is not the file madp batch wrote: {size} bytes with SHA-256 {digest.hexdigest()}, its "
                f"{REPORT_FILE} lists {entry.bytes} bytes with SHA-256 {entry.sha256}; re-run madp batch"
            )

    storage.write_whole(target, write)
    log.debug("copied %s (%s)", source, posixpath.basename(target))
