"""Splits of input files, so that many workers read one large file, each split read and validated
on its own (`record_reading.read_lines` and `read_parquet_rows` from the split's first row) and
the rules over a whole file judged afterwards from every split's facts (`record_reading.check_facts`):

- an uncompressed JSON Lines file in byte ranges of about `split_bytes`: a row belongs to the range
  its first byte lies in (as Hadoop's and Beam's text sources split lines), so the ranges hold every
  row exactly once; the rows before a range are counted in a first pass (`count_rows`), so rows are
  numbered as in the whole file;
- a Parquet file in runs of row groups of about `split_bytes` (row numbers from the row groups' counts);
- a gzipped file, or a file no larger than `split_bytes`, whole.
"""

from __future__ import annotations

from typing import BinaryIO, NamedTuple

from madp.core.record_reading import jsonl_rows

_BLOCK = 1 << 20  # bytes read at a time past a range's end, to finish its last row


class InputSplit(NamedTuple):
    """A part of input file `file_index` one worker reads: bytes `start` to `stop` of a JSON Lines
    file, or its row groups `start` to `stop` (Parquet). `first_row`: the file's rows before it, or
    None where they must be counted (a JSON Lines range after the first)."""

    file_index: int
    path: str
    start: int
    stop: int
    first_row: int | None


def jsonl_splits(file_index: int, path: str, size: int, split_bytes: int) -> list[InputSplit]:
    """The byte ranges of a JSON Lines file of `size` bytes (one, whole, for a .gz file or a small one)."""
    if path.endswith(".gz") or size <= split_bytes:
        return [InputSplit(file_index, path, 0, size, 0)]
    return [
        InputSplit(file_index, path, start, min(start + split_bytes, size), None)
        for start in range(0, size, split_bytes)
    ]


def parquet_splits(file_index: int, path: str, row_groups: list[tuple[int, int]], split_bytes: int) -> list[InputSplit]:
    """Runs of row groups (each `(rows, bytes)`) of about `split_bytes`, with their first rows; one
    empty split for a file without row groups."""
    splits, start, first_row, rows, size = [], 0, 0, 0, 0
    for group, (group_rows, group_bytes) in enumerate(row_groups):
        rows, size = rows + group_rows, size + group_bytes
        if size >= split_bytes or group == len(row_groups) - 1:
            splits.append(InputSplit(file_index, path, start, group + 1, first_row))
            start, first_row, rows, size = group + 1, first_row + rows, 0, 0
    return splits or [InputSplit(file_index, path, 0, 0, 0)]


def range_bytes(handle: BinaryIO, start: int, stop: int) -> bytes:
    """The bytes of the rows (LF-terminated lines) whose first byte lies in [start, stop) of the
    seekable file `handle`: the row running across `start` belongs to the range before, the row
    running across `stop` to this one."""
    position = 0
    if start > 0:
        handle.seek(start - 1)  # from the byte before: a row starts at `start` when that byte is a LF
        position = start - 1 + _through_line_feed(handle)
    if position >= stop:
        return b""
    handle.seek(position)
    data = handle.read(stop - position)
    if len(data) == stop - position and not data.endswith(b"\n"):
        rest = bytearray()
        _through_line_feed(handle, rest)
        data += bytes(rest)
    return data


def _through_line_feed(handle: BinaryIO, into: bytearray | None = None) -> int:
    """Read up to and including the next LF (or to the end); the bytes read, kept in `into`."""
    consumed = 0
    while block := handle.read(_BLOCK):
        end = block.find(b"\n")
        taken = block if end < 0 else block[: end + 1]
        consumed += len(taken)
        if into is not None:
            into += taken
        if end >= 0:
            return consumed
    return consumed


def count_rows(data: bytes, at_file_start: bool) -> int:
    """The rows of a range's bytes, by the row rules (blank lines do not count)."""
    return len(jsonl_rows(data, at_file_start))


def first_row(split: InputSplit, counts: dict[tuple[int, int], int]) -> int:
    """The rows of the split's file before it: its own `first_row`, or the sum of the counted rows
    (`counts[(file index, start)]`) of the ranges before it."""
    if split.first_row is not None:
        return split.first_row
    return sum(rows for (index, start), rows in counts.items() if index == split.file_index and start < split.start)
