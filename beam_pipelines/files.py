"""Files that a step of our pipelines reads or writes, through Beam's `FileSystems`: the file systems
the runner is set up with (local paths, gs://, s3://, hdfs://, ...), so that a worker needs no other
client than Beam's own. A file is written whole or not at all: under a hidden temporary name beside
it, then renamed into place, so that a retried or killed bundle never leaves a truncated file.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems


def write_whole(path: str, write: Callable[[Any], object]) -> None:
    """Call `write(handle)` on a binary handle whose bytes become the file `path`."""
    directory, name = FileSystems.split(path)
    temporary = FileSystems.join(directory, f".{name}.{uuid.uuid4().hex}.tmp")
    try:
        with FileSystems.create(temporary, compression_type=CompressionTypes.UNCOMPRESSED) as handle:
            write(handle)
        move(temporary, path)
    except BaseException:
        if FileSystems.exists(temporary):
            FileSystems.delete([temporary])
        raise


def move(source: str, target: str) -> None:
    """Put the file `source` in place of `target` (a rename; on object stores a copy, then a delete)."""
    if FileSystems.exists(target):
        FileSystems.delete([target])  # object stores do not rename over an existing object
    FileSystems.rename([source], [target])


def write_bytes(path: str, data: bytes) -> None:
    write_whole(path, lambda handle: handle.write(data))


def read_bytes(path: str) -> bytes:
    with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as handle:
        return handle.read()


def files_under(directory: str) -> list[str]:
    """The files directly or indirectly under `directory`, sorted (none when it does not exist)."""
    if not FileSystems.exists(directory):
        return []
    (match,) = FileSystems.match([FileSystems.join(directory, "**")])
    return sorted(metadata.path for metadata in match.metadata_list)
