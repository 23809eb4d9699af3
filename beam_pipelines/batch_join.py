"""Batching on Beam, the steps before sampling: split the records and the selection into record
partitions, join them, and count the units by |N(e)| (Alg. 3 line 1), from which p is calibrated in
the graph (`min_sep_sample.MinSepSample`).

  (records, selection) -> record partitions (join) -> user partitions (neighbour pairs)
        -> record partitions (|N(e)| per record) -> one histogram

Every element carries its arrays: a partition's state or the slice of it sent to another partition,
keyed by the receiving partition; each join is a CoGroupByKey or a GroupByKey on that key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import apache_beam as beam
import numpy as np
import pyarrow as pa

from madp.beam.pipeline import (
    Chunk,
    SelectionTable,
    keeping_input_errors,
    keeps_input_errors,
    merged_records,
)
from madp.beam.record_chunks import SplitByRecordPartition
from madp.core import records as rec
from madp.core import sampling
from madp.core.batch_files import Feature
from madp.core.columnar import Columnar
from madp.core.errors import InputError
from madp.core.graph_digest import EMPTY as EMPTY_GRAPH
from madp.core.graph_digest import GraphDigest, graph_digest
from madp.core.hashing import partition_of
from madp.core.routing import split_by_partition
from madp.core.selection import selection_arrays
from madp.engines import batching
from madp.engines.batch_report import merge_counts


@dataclasses.dataclass(frozen=True)
class SelectedIds(Columnar):
    """Selected ids sent to their record partition, with their copies (aligned)."""

    ids: pa.Array
    copies: np.ndarray


@dataclasses.dataclass(frozen=True)
class JoinedPartition(Columnar):
    """A record partition's selected records, joined with their copies and keyed: all that the
    sampling and the writing need of them. Aligned per record but `users` (CSR by `offsets`)."""

    ids: pa.Array
    copies: np.ndarray
    offsets: np.ndarray
    users: np.ndarray  # keyed hashes of the records' users (uint64)
    content: pa.Table
    record_keys: np.ndarray  # keyed hashes of the ids (uint64)
    valid: np.ndarray  # False: invalid content, sampled like any record but its rows left out


@dataclasses.dataclass(frozen=True)
class Incidences(Columnar):
    """(user, record) incidences sent to the user's partition: the record's key and copies per incidence."""

    users: np.ndarray
    record_keys: np.ndarray
    copies: np.ndarray


@dataclasses.dataclass(frozen=True)
class NeighbourPairs(Columnar):
    """(record, neighbour) pairs sent to the record's partition: both keys and the neighbour's copies."""

    owners: np.ndarray
    neighbours: np.ndarray
    neighbour_copies: np.ndarray


def user_partition_of(hashes: np.ndarray, partitions: int) -> np.ndarray:
    return (hashes % np.uint64(partitions)).astype(np.int64)


def summary_value(name: str, value) -> beam.pvalue.TaggedOutput:
    """A named value of any kind (a histogram, a file's counts) for the run's summary; unlike
    `pipeline.stat`, no Beam counter."""
    return beam.pvalue.TaggedOutput("stats", (name, value))


def record_partition_of(record_keys: np.ndarray, partitions: int) -> np.ndarray:
    return partition_of(record_keys.view(np.int64), partitions)


def split_rows(destination: np.ndarray) -> Iterable[tuple[int, np.ndarray]]:
    """(partition, the row indices sent to it) for each partition in `destination`, rows in order."""
    return split_by_partition(np.arange(len(destination)), destination)


@beam.typehints.with_input_types(SelectionTable)
@beam.typehints.with_output_types(tuple[int, SelectedIds])
class _SplitSelection(beam.DoFn):
    """A selection table -> (record partition, its ids and copies) for each partition it has ids of."""

    def __init__(self, partitions: int, errors_dir: str | None):
        self.partitions, self.errors_dir = partitions, errors_dir

    @keeps_input_errors
    def process(self, element):
        shard, table = element  # a shard index, or the path of the file it was read from
        ids, copies = selection_arrays(table, shard if isinstance(shard, str) else f"selection shard {shard}")
        destination = partition_of(ids, self.partitions) if len(ids) else np.zeros(0, np.int64)
        for part, rows in split_rows(destination):
            yield part, SelectedIds(ids.take(pa.array(rows)), copies[rows])


@beam.typehints.with_output_types(tuple[int, Incidences])
class _JoinSelection(beam.DoFn):
    """A record partition's records and selected ids -> its JoinedPartition ("partitions"), and its
    incidences sent to their user partitions (main)."""

    def __init__(self, options: batching.BatchOptions, data: str, partitions: int, errors_dir: str | None):
        self.options, self.data, self.partitions, self.errors_dir = options, data, partitions, errors_dir

    @keeps_input_errors
    def process(self, element):
        part, grouped = element
        rejects = rec.Rejects()
        chunk = merged_records(grouped["records"], rejects) if grouped["records"] else None
        if len(rejects):
            yield beam.pvalue.TaggedOutput("rejects", rejects)
        if chunk is not None:  # the partition's part of DATA's graph, before the join and any content check
            yield beam.pvalue.TaggedOutput("digest", graph_digest(chunk.ids, chunk.offsets, chunk.users))
        selection = list(grouped["selection"])
        if selection:
            yield from self._join(part, chunk, selection)

    def _join(self, part: int, chunk: rec.RecordChunk | None, selection: list):
        ids = pa.concat_arrays([s.ids for s in selection])
        copies = np.concatenate([s.copies for s in selection])
        if chunk is None:
            raise InputError(
                f"{len(ids)} selected ids are not valid records of {self.data} "
                f"(e.g. {ids[0].as_py()!r}): was SELECTED bounded from this data?"
            )
        chunk, copies = batching.join_selection(chunk, ids, copies, self.data)
        valid = np.ones(len(copies), dtype=bool)  # under --on-invalid error, check_content refuses invalid content
        if self.options.on_invalid == "skip":
            content_rejects = rec.Rejects()
            valid = batching.skip_invalid_content(chunk, content_rejects)
            if len(content_rejects):
                yield beam.pvalue.TaggedOutput("rejects", content_rejects)
        # (records whose rows are written, their content's description)
        described = batching.check_content(chunk.content, chunk.ids, valid)
        yield beam.pvalue.TaggedOutput("content", (int(valid.sum()), described))
        yield summary_value("records", len(copies))
        yield summary_value("id_type", chunk.ids.type)
        users = batching.user_hashes(chunk.users, self.options.key)
        record_keys = batching.record_hashes(chunk.ids, self.options.key)
        joined = JoinedPartition(chunk.ids, copies, chunk.offsets, users, chunk.content, record_keys, valid)
        yield beam.pvalue.TaggedOutput("partitions", (part, joined))
        record_of_incidence = np.repeat(np.arange(len(copies)), np.diff(chunk.offsets))
        for user_part, rows in split_rows(user_partition_of(users, self.partitions)):
            record = record_of_incidence[rows]
            yield user_part, Incidences(users[rows], record_keys[record], copies[record])


@beam.typehints.with_input_types(tuple[int, Iterable[Incidences]])
@beam.typehints.with_output_types(tuple[int, NeighbourPairs])
class _NeighbourPairs(beam.DoFn):
    """Within a user partition: the (record, neighbour) pairs its users make, sent to the record's partition."""

    def __init__(self, partitions: int):
        self.partitions = partitions

    def process(self, element):
        _, pieces = element
        pieces = list(pieces)
        users = np.concatenate([p.users for p in pieces])
        record_keys = np.concatenate([p.record_keys for p in pieces])
        copies = np.concatenate([p.copies for p in pieces])
        keys, first, local = np.unique(record_keys, return_index=True, return_inverse=True)
        for owner, neighbour in sampling.neighbour_pairs(local.ravel(), users):
            owner_keys, neighbour_keys, neighbour_copies = keys[owner], keys[neighbour], copies[first[neighbour]]
            for part, rows in split_rows(record_partition_of(owner_keys, self.partitions)):
                yield part, NeighbourPairs(owner_keys[rows], neighbour_keys[rows], neighbour_copies[rows])


def _neighbourhood_histogram(element: tuple[int, Iterable[NeighbourPairs]]):
    """A record partition's units counted by |N(e)|, from the pairs its records' users formed."""
    _, pieces = element
    pieces = list(pieces)
    sizes, units = sampling.neighbourhood_sizes_of_pairs(
        np.concatenate([p.owners for p in pieces]),
        np.concatenate([p.neighbours for p in pieces]),
        np.concatenate([p.neighbour_copies for p in pieces]),
    )
    values, counts = sampling.size_histogram(np.repeat(sizes, units))
    yield dict(zip(values.tolist(), counts.tolist()))


def _merged_content(described: list[tuple[int, dict[str, Feature]]], errors_dir: str | None) -> dict[str, Feature]:
    """The content columns' description over all record partitions that write rows (of all where none
    does, as the local engine describes zero rows): a column whose shape differs between partitions
    is variable-length; one whose type differs is an error. A partition whose records are all left
    out (invalid content) would describe a list column from no rows as variable-length."""
    merged: dict[str, Feature] = {}
    writing = [one for rows, one in described if rows] or [one for _, one in described]
    with keeping_input_errors(errors_dir):
        for one in writing:
            for name, feature in one.items():
                seen = merged.setdefault(name, feature)
                if seen.dtype != feature.dtype:
                    raise InputError(
                        f"content column {name!r} is {seen.dtype} in some records and {feature.dtype} in others"
                    )
                if seen.shape != feature.shape:
                    merged[name] = dataclasses.replace(seen, shape=(None,))
    return merged


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
            {
                # (record partition, RecordChunk): a file's records in the partition
                "records": records | "SplitRecords" >> beam.ParDo(SplitByRecordPartition(partitions)),
                # (record partition, SelectedIds): a selection table's ids in the partition
                "selection": selection | "SplitSelection" >> beam.ParDo(_SplitSelection(partitions, errors_dir)),
            }
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
