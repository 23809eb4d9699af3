"""Records as (file index, RecordChunk) elements, the first steps of the bounding and the batching
alike: read and validated from input files, then handed to their record partitions (by id hash) as
(record partition, RecordChunk) elements.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from typing import Any

import apache_beam as beam
import numpy as np

from beam_pipelines.pipeline import Chunk, keeps_input_errors, stat
from madp.core import record_reading
from madp.core import records as rec
from madp.core.errors import InputError
from madp.core.hashing import partition_of


@beam.typehints.with_input_types(tuple[int, str])
@beam.typehints.with_output_types(Chunk)
class _ReadFile(beam.DoFn):
    """Read and validate one input file: (file index, chunk of its valid records); rejects and counts."""

    def __init__(self, columns: rec.Columns, content: tuple[str, ...] | None, errors_dir: str | None):
        self.columns, self.content, self.errors_dir = columns, content, errors_dir

    @keeps_input_errors
    def process(self, element):
        index, path = element
        yield from _read_outputs(index, record_reading.read_file(path, index, self.columns, self.content))


def _read_outputs(index: int, result: rec.FileResult):
    """A read chunk's outputs: (index, chunk), its rejected rows (a "rejects" output) and counts ("stats")."""
    yield stat("input_rows", result.rows_read)
    yield from (stat(f"rejected_{reason}", count) for reason, count in result.rejects.counts().items())
    yield stat("repeated_users_removed", result.repeated_users_removed)
    if len(result.rejects):
        yield beam.pvalue.TaggedOutput("rejects", result.rejects)
    yield index, result.chunk


@beam.typehints.with_input_types(Chunk)
@beam.typehints.with_output_types(Chunk)
class SplitByRecordPartition(beam.DoFn):
    """(file index, chunk) -> (record partition, the chunk's records in it), by id hash."""

    def __init__(self, partitions: int):
        self.partitions = partitions

    def process(self, element):
        _, chunk = element
        partition = partition_of(chunk.ids, self.partitions) if len(chunk) else np.zeros(0, np.int64)
        for part in np.unique(partition):
            yield int(part), rec.take(chunk, partition == part)


class ReadRecords(beam.PTransform):
    """Input files -> (file index, RecordChunk of its valid rows); the rejected rows and the counts.
    With `content`, the chunks carry those columns too (batching). The I/O of `madp bound` and `madp
    batch`: a pipeline of one's own may make the chunks another way, with `record_reading.read_file`
    (a chunk's record keys hold its file index, so indices must differ)."""

    def __init__(
        self,
        files: list[str],
        columns: rec.Columns,
        errors_dir: str | None = None,
        content: tuple[str, ...] | None = None,
    ):
        super().__init__()
        self.files, self.columns, self.errors_dir, self.content = files, columns, errors_dir, content

    def expand(self, pbegin):
        read = (
            pbegin
            | "ListFiles" >> beam.Create(list(enumerate(self.files)))
            | "SpreadFiles" >> beam.Reshuffle()
            | "ReadAndValidate"
            >> beam.ParDo(_ReadFile(self.columns, self.content, self.errors_dir)).with_outputs(
                "rejects", "stats", main="chunks"
            )
        )
        return read.chunks, read.rejects, read.stats


def _as_line(row, to_record: Callable[[Any], dict], chunks: int) -> tuple[int, bytes]:
    """A row as (chunk, its record as one JSON line); the chunk is a hash of the line, so it does not
    depend on how the runner bundles the rows."""
    record = to_record(row)
    try:
        line = json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    except (TypeError, ValueError) as error:
        raise InputError(f"a row's record is not JSON (ids, users and content must be): {error}: {record!r}") from error
    return zlib.crc32(line) % chunks, line


@beam.typehints.with_output_types(Chunk)
class _ReadLines(beam.DoFn):
    """One chunk of rows, in the order of their JSON, read and validated as a JSON Lines file is."""

    def __init__(self, columns: rec.Columns, content: tuple[str, ...] | None, errors_dir: str | None):
        self.columns, self.content, self.errors_dir = columns, content, errors_dir

    @keeps_input_errors
    def process(self, element):
        index, lines = element
        source = f"rows of chunk {index}"
        yield from _read_outputs(
            index, record_reading.read_lines(sorted(lines), source, index, self.columns, self.content)
        )


class RecordsFromRows(beam.PTransform):
    """A PCollection of one's own rows (from BigQuery, TFRecords, another pipeline: any elements) ->
    the (chunk index, RecordChunk) elements that `BoundContributions` and `MinSepSample` take, the
    `Rejects` of rows that are not valid records, and counts: each row is read and validated exactly
    as a row of a JSON Lines input file (README, Input).

    `to_record(row)` extracts the record as a JSON-serializable dict: the id (an int or a str) and the
    users (a list of them) under the `columns` names (`Columns()`: "id", "users"), a weight when
    `columns.weight` names one, and the content columns `content` names (for batching). Rows go to
    `chunks` chunks by a hash of their record, each chunk ordered by its records' JSON, so the chunks,
    and every result, are the same whatever the runner's bundling; chunk indices are 0..chunks-1
    (records from `ReadRecords` in the same pipeline would need other indices). Rejected rows name
    their chunk and their row in its order.

    Example::

        rows = pipeline | beam.io.ReadFromBigQuery(table="project:dataset.emails")
        chunks, rejects, _ = rows | RecordsFromRows(
            lambda row: {"id": row["message_id"], "users": [row["sender"], *row["recipients"]]}
        )
        bound = chunks | BoundContributions(BoundOptions(max_contributions=4), partitions=64)
    """

    def __init__(
        self,
        to_record: Callable[[Any], dict],
        columns: rec.Columns | None = None,
        content: tuple[str, ...] | None = None,
        chunks: int = 64,
        errors_dir: str | None = None,
    ):
        super().__init__()
        if not 1 <= chunks < 1 << 20:
            raise InputError("chunks must be between 1 and 2^20")
        self.to_record, self.columns, self.content = to_record, columns or rec.Columns(), content
        self.chunks, self.errors_dir = chunks, errors_dir

    def expand(self, rows):
        read = (
            rows
            | "AsLines" >> beam.Map(_as_line, self.to_record, self.chunks)
            | "GroupChunks" >> beam.GroupByKey()
            | "ReadAndValidate"
            >> beam.ParDo(_ReadLines(self.columns, self.content, self.errors_dir)).with_outputs(
                "rejects", "stats", main="chunks"
            )
        )
        return read.chunks, read.rejects, read.stats


@beam.typehints.with_input_types(Chunk)
class RecordPartitions(beam.PTransform):
    """(file index, RecordChunk) -> (record partition, [RecordChunk, ...]: its records, by input chunk)."""

    def __init__(self, partitions: int):
        super().__init__()
        self.partitions = partitions

    def expand(self, chunks):
        return (
            chunks
            | "SplitByRecordPartition" >> beam.ParDo(SplitByRecordPartition(self.partitions))
            | "GroupRecordPartitions" >> beam.GroupByKey()
        )
