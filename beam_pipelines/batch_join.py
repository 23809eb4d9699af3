"""Batching on Beam, the steps before sampling: split the records and the selection into record
partitions, join them, and count the units by |N(e)| (Alg. 3 line 1), from which p is calibrated in
the graph (`min_sep_sample.MinSepSample`).

  (records, selection) -> record partitions (join) -> user partitions (neighbour pairs)
        -> record partitions (|N(e)| per record) -> one histogram

Every element carries its arrays: a partition's state or the slice of it sent to another partition,
keyed by the receiving partition; each join is a CoGroupByKey or a GroupByKey on that key.
"""

from __future__ import annotations

from collections.abc import Iterable

import apache_beam as beam

from madp.beam.pipeline import (
    Chunk,
    SelectionTable,
    keeping_input_errors,
    keeps_input_errors,
)
from madp.beam.record_chunks import SplitByRecordPartition
from madp.core.batch_files import Feature
from madp.core.batch_steps import (
    Incidences,
    NeighbourPairs,
    SelectedIds,
    merged_content,
    neighbour_pairs_by_record,
    neighbourhood_histogram,
    split_selection,
)
from madp.core.graph_digest import EMPTY as EMPTY_GRAPH
from madp.core.graph_digest import GraphDigest
from madp.engines import batching
from madp.engines.batch_report import merge_counts


def summary_value(name: str, value) -> beam.pvalue.TaggedOutput:
    """A named value of any kind (a histogram, a file's counts) for the run's summary; unlike
    `pipeline.stat`, no Beam counter."""
    return beam.pvalue.TaggedOutput("stats", (name, value))


@beam.typehints.with_input_types(SelectionTable)
@beam.typehints.with_output_types(tuple[int, SelectedIds])
class _SplitSelection(beam.DoFn):
    """A selection table -> (record partition, its ids and copies) for each partition it has ids of
    (`batch_steps.split_selection`)."""

    def __init__(self, partitions: int, errors_dir: str | None):
        self.partitions, self.errors_dir = partitions, errors_dir

    @keeps_input_errors
    def process(self, element):
        shard, table = element  # a shard index, or the path of the file it was read from
        yield from split_selection(shard, table, self.partitions)


@beam.typehints.with_output_types(tuple[int, Incidences])
class _JoinSelection(beam.DoFn):
    """A record partition's records and selected ids -> its JoinedPartition ("partitions"), and its
    incidences sent to their user partitions (main) (`batching.join_record_partition`); the records'
    graph digest, the rejected rows, the content's description and summary values."""

    def __init__(self, options: batching.BatchOptions, data: str, partitions: int, errors_dir: str | None):
        self.options, self.data, self.partitions, self.errors_dir = options, data, partitions, errors_dir

    @keeps_input_errors
    def process(self, element):
        part, (records, selection) = element
        found = batching.join_record_partition(list(records), list(selection), self.options, self.data, self.partitions)
        if len(found.rejects):
            yield beam.pvalue.TaggedOutput("rejects", found.rejects)
        if found.digest is not None:
            yield beam.pvalue.TaggedOutput("digest", found.digest)
        result = found.joined
        if result is None:
            return
        if len(result.rejects):
            yield beam.pvalue.TaggedOutput("rejects", result.rejects)
        # (records whose rows are written, their content's description)
        yield beam.pvalue.TaggedOutput("content", (result.written_records, result.content))
        yield summary_value("records", result.records)
        yield summary_value("id_type", result.id_type)
        yield beam.pvalue.TaggedOutput("partitions", (part, result.joined))
        yield from result.incidences


@beam.typehints.with_input_types(tuple[int, Iterable[Incidences]])
@beam.typehints.with_output_types(tuple[int, NeighbourPairs])
class _NeighbourPairs(beam.DoFn):
    """Within a user partition: the (record, neighbour) pairs its users make, sent to the record's
    partition (`batch_steps.neighbour_pairs_by_record`)."""

    def __init__(self, partitions: int):
        self.partitions = partitions

    def process(self, element):
        _, pieces = element
        yield from neighbour_pairs_by_record(pieces, self.partitions)


def _neighbourhood_histogram(element: tuple[int, Iterable[NeighbourPairs]]):
    """A record partition's units counted by |N(e)| (`batch_steps.neighbourhood_histogram`)."""
    _, pieces = element
    yield neighbourhood_histogram(pieces)


def _merged_content(described: list[tuple[int, dict[str, Feature]]], errors_dir: str | None) -> dict[str, Feature]:
    """The content columns' description over all record partitions (`batch_steps.merged_content`)."""
    with keeping_input_errors(errors_dir):
        return merged_content(described)


@beam.typehints.with_input_types(Chunk, SelectionTable)
class JoinSelection(beam.PTransform):
    """(records, selection) -> joined record partitions (partition, JoinedPartition); incidences
    (user partition, Incidences); the content's description; rejected rows; summary values; and one
    GraphDigest of the records' graph (all valid records, selected or not)."""

    def __init__(self, options: batching.BatchOptions, data: str, partitions: int, errors_dir: str | None = None):
        super().__init__()
        self.options, self.data, self.partitions, self.errors_dir = options, data, partitions, errors_dir

    def expand(self, inputs):
        records, selection = inputs
        partitions, errors_dir = self.partitions, self.errors_dir
        joined = (
            # per record partition: (its RecordChunks, its SelectedIds)
            (
                # (record partition, RecordChunk): a file's records in the partition
                records | "SplitRecords" >> beam.ParDo(SplitByRecordPartition(partitions)),
                # (record partition, SelectedIds): a selection table's ids in the partition
                selection | "SplitSelection" >> beam.ParDo(_SplitSelection(partitions, errors_dir)),
            )
            | "GroupRecordPartitions" >> beam.CoGroupByKey()
            | "Join"
            >> beam.ParDo(_JoinSelection(self.options, self.data, partitions, errors_dir)).with_outputs(
                "partitions", "content", "rejects", "stats", "digest", main="incidences"
            )
        )
        # One {column: Feature} description, from each partition's (rows written, description)
        content = (
            joined.content
            | "ContentOfPartitions" >> beam.combiners.ToList()
            | "MergeContent" >> beam.Map(_merged_content, errors_dir)
        )
        # One GraphDigest, of every record partition's valid records
        digest = joined.digest | "GraphDigest" >> beam.CombineGlobally(_sum_digests)
        return joined.partitions, joined.incidences, content, joined.rejects, joined.stats, digest


def _sum_digests(parts: Iterable[GraphDigest]) -> GraphDigest:
    """Partial graph digests added up (the digest of no record for none)."""
    return sum(parts, EMPTY_GRAPH)


@beam.typehints.with_input_types(tuple[int, Incidences])
class NeighbourhoodHistogram(beam.PTransform):
    """Incidences (user partition, Incidences) -> one {|N(e)|: units} histogram over all units (Alg. 3 line 1)."""

    def __init__(self, partitions: int):
        super().__init__()
        self.partitions = partitions

    def expand(self, incidences):
        return (
            incidences
            | "GroupUserPartitions" >> beam.GroupByKey()
            # (record partition, NeighbourPairs): pairs of a user partition's users, by owning record
            | "NeighbourPairs" >> beam.ParDo(_NeighbourPairs(self.partitions))
            | "GroupPairsByRecord" >> beam.GroupByKey()
            # {|N(e)|: units} of a record partition
            | "CountByNeighbourhood" >> beam.FlatMap(_neighbourhood_histogram)
            | "MergeHistograms" >> beam.CombineGlobally(merge_counts)
        )
