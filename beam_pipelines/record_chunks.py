"""Records as (file index, RecordChunk) elements, the first steps of the bounding and the batching
alike: read and validated from input files, then handed to their record partitions (by id hash) as
(record partition, RecordChunk) elements.
"""

from __future__ import annotations

import apache_beam as beam
import numpy as np

from beam_pipelines.pipeline import Chunk, keeps_input_errors, stat
from madp.core import record_reading
from madp.core import records as rec
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
        result = record_reading.read_file(path, index, self.columns, self.content)
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
