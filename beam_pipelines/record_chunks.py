"""Records as (file index, RecordChunk) elements, the first steps of the bounding and the batching
alike: read and validated from input files, then handed to their record partitions (by id hash).
"""

from __future__ import annotations

import apache_beam as beam
import numpy as np

from beam_pipelines.pipeline import Chunk, Sent, keeps_input_errors, stat
from beam_pipelines.store import PartitionStore
from madp.core import record_reading
from madp.core import records as rec
from madp.core.hashing import partition_of


@beam.typehints.with_input_types(tuple[int, str])
@beam.typehints.with_output_types(Chunk)
class _ReadFile(beam.DoFn):
    """Read and validate one input file: (file index, chunk of its valid records); rejects and counts."""

    def __init__(self, columns: rec.Columns, content: tuple[str, ...] | None, store: PartitionStore):
        self.columns, self.content, self.store = columns, content, store

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
@beam.typehints.with_output_types(Sent)
class SplitByRecordPartition(beam.DoFn):
    """Hand a chunk's records to their record partitions (by id hash), one store file per chunk."""

    def __init__(self, partitions: int, store: PartitionStore):
        self.partitions, self.store = partitions, store

    def process(self, element):
        index, chunk = element
        partition = partition_of(chunk.ids, self.partitions) if len(chunk) else np.zeros(0, np.int64)
        slices = {int(part): rec.take(chunk, partition == part) for part in np.unique(partition)}
        yield from self.store.write_slices(f"chunks-from-file{index:06d}.store", slices).items()


class ReadRecords(beam.PTransform):
    """Input files -> (file index, RecordChunk of its valid rows); the rejected rows and the counts.
    With `content`, the chunks carry those columns too (batching). The I/O of `madp bound` and `madp
    batch`: a pipeline of one's own may make the chunks another way, with `record_reading.read_file`
    (a chunk's record keys hold its file index, so indices must differ)."""

    def __init__(
        self, files: list[str], columns: rec.Columns, store: PartitionStore, content: tuple[str, ...] | None = None
    ):
        super().__init__()
        self.files, self.columns, self.store, self.content = files, columns, store, content

    def expand(self, pbegin):
        read = (
            pbegin
            | "ListFiles" >> beam.Create(list(enumerate(self.files)))
            | "SpreadFiles" >> beam.Reshuffle()
            | "ReadAndValidate"
            >> beam.ParDo(_ReadFile(self.columns, self.content, self.store)).with_outputs(
                "rejects", "stats", main="chunks"
            )
        )
        return read.chunks, read.rejects, read.stats


@beam.typehints.with_input_types(Chunk)
class RecordPartitions(beam.PTransform):
    """(file index, RecordChunk) -> (record partition, store handles of its records' slices)."""

    def __init__(self, partitions: int, store: PartitionStore):
        super().__init__()
        self.partitions, self.store = partitions, store

    def expand(self, chunks):
        return (
            chunks
            | "SplitByRecordPartition" >> beam.ParDo(SplitByRecordPartition(self.partitions, self.store))
            | "GroupRecordPartitions" >> beam.GroupByKey()
        )
