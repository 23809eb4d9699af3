"""Splits of input files, so that many workers read one large file, each split read and validated
on its own (`record_reading.read_jsonl` and `read_parquet_rows` from the split's first row) and
the rules over a whole file judged afterwards from every split's facts (`record_reading.check_facts`):

- an uncompressed JSON Lines file in byte ranges of about `split_bytes`: a row belongs to the range
  its first byte lies in (as Hadoop's and Beam's text sources split lines), so the ranges hold every
  row exactly once; the rows before a range are counted in a first pass (`count_rows`), so rows are
  numbered as in the whole file;
- a Parquet file in runs of row groups of about `split_bytes` (row numbers from the row groups' counts);
- a gzipped file, or a file no larger than `split_bytes`, whole.

A worker reads its split in pieces of about `PIECE_BYTES` (`read_planned_pieces`): a piece is read and
validated as a split of its own, so a worker holds one piece's rows, not its split's, whatever the
split's size (a Parquet file's row groups may each be far larger than a split).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import BinaryIO, NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq

from madp.core import record_reading, storage
from madp.core.errors import InputError
from madp.core.record_reading import Content, jsonl_rows
from madp.core.records import Columns, FileResult

_BLOCK = 1 << 20  # bytes read at a time past a range's end, to finish its last row
# A split is read and validated in pieces of about this many bytes of JSON Lines, or of a Parquet row
# group's uncompressed data: rows take several times their input's size while they are validated, and
# a split (or one row group) may hold millions. At 10M records, in splits of two row groups of 1M
# records, Spark's reading Python workers peaked at 280-345 MB in pieces, 660-820 MB whole.
PIECE_BYTES = 8 << 20


class InputSplit(NamedTuple):
    """A part of input file `file_index` one worker reads: bytes `start` to `stop` of a JSON Lines
    file, or its row groups `start` to `stop` (Parquet). `first_row`: the file's rows before it, or
    None where they must be counted (a JSON Lines range after the first)."""

    file_index: int
    path: str
    start: int
    stop: int
    first_row: int | None
    file_size: int  # bytes when planned: a file that changes while it is read is an error

    @property
    def counted(self) -> bool:
        """Whether the rows before it are counted in a first pass (`row_count`): a JSON Lines range
        after the first."""
        return self.first_row is None


def jsonl_splits(file_index: int, path: str, size: int, split_bytes: int) -> list[InputSplit]:
    """The byte ranges of a JSON Lines file of `size` bytes (one, whole, for a .gz file or a small one)."""
    if path.endswith(".gz") or size <= split_bytes:
        return [InputSplit(file_index, path, 0, size, 0, size)]
    return [
        InputSplit(file_index, path, start, min(start + split_bytes, size), None, size)
        for start in range(0, size, split_bytes)
    ]


def parquet_splits(
    file_index: int, path: str, size: int, row_groups: list[tuple[int, int]], split_bytes: int
) -> list[InputSplit]:
    """Runs of row groups (each `(rows, bytes)`) of about `split_bytes` of a Parquet file of `size`
    bytes, with their first rows; one empty split for a file without row groups."""
    splits: list[InputSplit] = []
    start, first_row, rows, run_bytes = 0, 0, 0, 0
    for group, (group_rows, group_bytes) in enumerate(row_groups):
        rows, run_bytes = rows + group_rows, run_bytes + group_bytes
        if run_bytes >= split_bytes or group == len(row_groups) - 1:
            splits.append(InputSplit(file_index, path, start, group + 1, first_row, size))
            start, first_row, rows, run_bytes = group + 1, first_row + rows, 0, 0
    return splits or [InputSplit(file_index, path, 0, 0, 0, size)]


def range_bytes(handle: BinaryIO, start: int, stop: int) -> bytes:
    """The bytes of the rows (LF-terminated lines) whose first byte lies in [start, stop) of the
    seekable file `handle`: the row running across `start` belongs to the range before, the row
    running across `stop` to this one. Each byte is read by at most two ranges, however long the rows
    (a range inside one long row reads only itself and finds no row)."""
    position = 0
    if start > 0:
        handle.seek(start - 1)  # from the byte before: a row starts at `start` when that byte is a LF
        skipped, found = _through_line_feed(handle, stop - start)
        if not found:
            return b""
        position = start - 1 + skipped
    if position >= stop:
        return b""
    handle.seek(position)
    data = handle.read(stop - position)
    if len(data) == stop - position and not data.endswith(b"\n"):
        rest = bytearray()
        _through_line_feed(handle, None, rest)
        data += bytes(rest)
    return data


def _through_line_feed(handle: BinaryIO, limit: int | None, into: bytearray | None = None) -> tuple[int, bool]:
    """Read up to and including the next LF, within `limit` bytes (None: to the end of the file): the
    bytes read (kept in `into`) and whether a LF ended them."""
    consumed = 0
    while limit is None or consumed < limit:
        block = handle.read(_BLOCK if limit is None else min(_BLOCK, limit - consumed))
        if not block:
            break
        end = block.find(b"\n")
        taken = block if end < 0 else block[: end + 1]
        consumed += len(taken)
        if into is not None:
            into += taken
        if end >= 0:
            return consumed, True
    return consumed, False


def row_groups(metadata: pq.FileMetaData) -> list[tuple[int, int]]:
    """(rows, bytes) of each row group of a Parquet file, as `parquet_splits` takes them."""
    groups = [metadata.row_group(g) for g in range(metadata.num_row_groups)]
    return [(g.num_rows, g.total_byte_size) for g in groups]


def row_count(split: InputSplit, data: bytes) -> tuple[tuple[int, int], int]:
    """The first pass over a `counted` range, its bytes `data`: ((file index, start), its rows),
    from which `first_rows` numbers the rows of every range as in the whole file."""
    return (split.file_index, split.start), count_rows(data, split.start == 0)


def jsonl_pieces(data: bytes, piece_bytes: int) -> Iterator[tuple[int, bytes]]:
    """(offset, bytes) of whole rows of a range's bytes `data`, about `piece_bytes` each: each piece
    ends at a LF (or at the end of `data`), so each row lies in exactly one piece."""
    start = 0
    while start < len(data):
        end = data.find(b"\n", start + piece_bytes - 1)
        stop = len(data) if end < 0 else end + 1
        yield start, data[start:stop]
        start = stop


def parquet_piece_rows(metadata: pq.FileMetaData, groups: range, piece_bytes: int) -> int:
    """The rows of a piece of about `piece_bytes` of the row groups `groups`' uncompressed data."""
    rows = sum(metadata.row_group(g).num_rows for g in groups)
    data = sum(metadata.row_group(g).total_byte_size for g in groups)
    return max(1, rows * piece_bytes // max(1, data))


def count_rows(data: bytes, at_file_start: bool) -> int:
    """The rows of a range's bytes, by the row rules (blank lines do not count)."""
    return len(jsonl_rows(data, at_file_start))


def first_rows(counts: dict[tuple[int, int], int]) -> dict[tuple[int, int], int]:
    """Per range (file index, start), the rows of its file before it: cumulative sums of the counted
    rows (`counts[(file index, start)]`) in start order."""
    before: dict[tuple[int, int], int] = {}
    total: dict[int, int] = {}
    for index, start in sorted(counts):
        before[(index, start)] = total.get(index, 0)
        total[index] = before[(index, start)] + counts[(index, start)]
    return before


def first_row(split: InputSplit, before: dict[tuple[int, int], int]) -> int:
    """The rows of the split's file before it: its own `first_row`, or from `first_rows`."""
    return split.first_row if split.first_row is not None else before[(split.file_index, split.start)]


class FileAccess(NamedTuple):
    """How an engine's workers open input files: `open(path)`, a context manager of a seekable binary
    handle, and the errors it raises where a file cannot be read (each an InputError naming the file).
    `STORAGE` opens them as `madp.core.storage` does (local paths and the URLs pyarrow reads)."""

    open: Callable[[str], AbstractContextManager]
    errors: tuple[type[BaseException], ...] = (OSError,)


STORAGE = FileAccess(storage.open_input)


@contextlib.contextmanager
def opened(path: str, access: FileAccess, planned_size: int | None = None) -> Iterator[tuple[BinaryIO, int]]:
    """(binary handle, size) of an input file; an unreadable file, or one whose size is no longer
    `planned_size`, is an error naming it."""
    try:
        with access.open(path) as handle:
            size = handle.seek(0, os.SEEK_END)  # not a listing, which may glob a path's [ ] * ?
            if planned_size is not None and size != planned_size:
                raise InputError(f"{path}: changed while it was read ({size} bytes, {planned_size} when planned)")
            handle.seek(0)
            yield handle, size
    except access.errors as error:
        raise InputError(f"{path}: cannot be read ({error})") from error


@contextlib.contextmanager
def parquet_opened(
    path: str, access: FileAccess, planned_size: int | None = None
) -> Iterator[tuple[pq.ParquetFile, int]]:
    """(ParquetFile, size) of a Parquet input file, its pages checked against their checksums; an
    unreadable file is an error naming it."""
    with opened(path, access, planned_size) as (handle, size):
        try:
            yield pq.ParquetFile(handle, page_checksum_verification=True), size
        except (pa.ArrowInvalid, OSError) as error:
            raise InputError(f"{path}: not a readable Parquet file ({error})") from error


def plan_splits(file_index: int, path: str, split_bytes: int, access: FileAccess) -> list[InputSplit]:
    """An input file's splits, from its size or its Parquet row groups."""
    if not path.endswith(".parquet"):
        with opened(path, access) as (_, size):
            return jsonl_splits(file_index, path, size, split_bytes)
    with parquet_opened(path, access) as (parquet, size):
        return parquet_splits(file_index, path, size, row_groups(parquet.metadata), split_bytes)


def split_range(split: InputSplit, access: FileAccess) -> bytes:
    """A JSON Lines split's bytes (a whole .gz file decompressed)."""
    with opened(split.path, access, split.file_size) as (handle, _):
        if split.first_row is None:
            return range_bytes(handle, split.start, split.stop)
        data = handle.read()
    return record_reading.decompressed(split.path, data)


def count_split(split: InputSplit, access: FileAccess) -> tuple[tuple[int, int], int]:
    """The first pass over a `counted` range: ((file index, start), its rows) (`row_count`)."""
    return row_count(split, split_range(split, access))


def read_planned_pieces(
    split: InputSplit,
    columns: Columns,
    content: Content,
    first_row: int,
    access: FileAccess,
    piece_bytes: int | None = None,
) -> Iterator[FileResult]:
    """A planned split read and validated in pieces of about `piece_bytes` (None: PIECE_BYTES), each as its
    part of the whole file (`record_reading.read_parquet_rows`, `record_reading.read_jsonl`), its rows
    numbered from `first_row` on (`first_row` gives the split's); at least one piece, empty where the split
    has no row."""
    piece_bytes = piece_bytes or PIECE_BYTES
    if not split.path.endswith(".parquet"):
        data = split_range(split, access)
        if not data:
            yield record_reading.read_jsonl(data, split.path, split.file_index, columns, content, first_row)
        for offset, piece in jsonl_pieces(data, piece_bytes):
            at_file_start = split.start == 0 and offset == 0
            result = record_reading.read_jsonl(
                piece, split.path, split.file_index, columns, content, first_row, at_file_start
            )
            first_row += result.rows_read
            yield result
        return
    with parquet_opened(split.path, access, split.file_size) as (parquet, _):
        names = record_reading.parquet_read_columns(split.path, parquet.schema_arrow.names, columns, content)
        groups = range(split.start, split.stop)
        rows = parquet_piece_rows(parquet.metadata, groups, piece_bytes)
        batches = parquet.iter_batches(rows, row_groups=groups, columns=names) if groups else ()
        schema = pa.schema([parquet.schema_arrow.field(name) for name in names])
        yield from arrow_pieces(batches, schema, split.path, split.file_index, columns, content, first_row, piece_bytes)


def arrow_pieces(
    batches: Iterable[pa.RecordBatch],
    schema: pa.Schema,
    source: str,
    file_index: int,
    columns: Columns,
    content: Content,
    first_row: int,
    piece_bytes: int,
) -> Iterator[FileResult]:
    """Arrow `batches` of `schema` (a Parquet split's, a DataFrame partition's), as they come, read and
    validated as Parquet rows (`record_reading.read_parquet_rows`) in pieces of about `piece_bytes`, rows
    numbered from `first_row` on; at least one piece, empty where there is no row (its facts, the columns
    and their types, still count)."""
    held: list[pa.RecordBatch] = []
    held_bytes, read = 0, 0
    for batch in batches:
        held.append(batch)
        held_bytes += batch.nbytes
        if held_bytes >= piece_bytes:
            table = pa.Table.from_batches(held, schema)
            yield record_reading.read_parquet_rows(table, source, file_index, columns, content, first_row + read)
            held, held_bytes, read = [], 0, read + len(table)
    if held or not read:
        table = pa.Table.from_batches(held, schema)
        yield record_reading.read_parquet_rows(table, source, file_index, columns, content, first_row + read)
