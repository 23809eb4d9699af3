"""Batching on Beam, the steps before sampling: split the records and the selection into record
partitions, join them, store each joined partition, and count the units by |N(e)| (Alg. 3 line 1),
from which p is calibrated in the graph (`min_sep_sample.MinSepSample`).

  (records, selection) -> record partitions (join) -> user partitions (neighbour pairs)
        -> record partitions (|N(e)| per record) -> one histogram
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable

import apache_beam as beam
import numpy as np
import pyarrow as pa

from beam_pipelines.pipeline import (
    Chunk,
    SelectionTable,
    Sent,
    keeping_input_errors,
    keeps_input_errors,
    merged_records,
)
from beam_pipelines.record_chunks import SplitByRecordPartition
from beam_pipelines.store import PartitionStore, Slice, stack
from madp.core import records as rec
from madp.core import sampling
from madp.core.errors import InputError
from madp.core.graph_digest import EMPTY as EMPTY_GRAPH
from madp.core.graph_digest import GraphDigest, graph_digest
from madp.core.hashing import partition_of
from madp.engines import batching
from madp.engines.batch_report import merge_counts


def user_partition_of(hashes: np.ndarray, partitions: int) -> np.ndarray:
    return (hashes % np.uint64(partitions)).astype(np.int64)


def summary_value(name: str, value) -> beam.pvalue.TaggedOutput:
    """A named value of any kind (a histogram, a file's counts) for the run's summary; unlike
    `bound_rounds.stat`, no Beam counter."""
    return beam.pvalue.TaggedOutput("stats", (name, value))


def record_partition_of(record_keys: np.ndarray, partitions: int) -> np.ndarray:
    return partition_of(record_keys.view(np.int64), partitions)


@beam.typehints.with_input_types(SelectionTable)
@beam.typehints.with_output_types(Sent)
class _SplitSelection(beam.DoFn):
    """Hand a selection table's ids (and copies) to their record partitions, one store file per table."""

    def __init__(self, partitions: int, store: PartitionStore):
        self.partitions, self.store = partitions, store

    @keeps_input_errors
    def process(self, element):
        shard, table = element  # a shard index, or the path of the file it was read from
        ids, copies = batching.selection_arrays(table, shard if isinstance(shard, str) else f"selection shard {shard}")
        destination = partition_of(ids, self.partitions) if len(ids) else np.zeros(0, np.int64)
        yield from self.store.write_split(
            f"selection-{uuid.uuid4().hex}.store",  # a shard may come in several tables
            destination,
            lambda mask: (ids.filter(pa.array(mask)), copies[mask]),
        )


@beam.typehints.with_output_types(Sent)
class _JoinSelection(beam.DoFn):
    """Join a record partition with its selected ids; store it; send incidences to user partitions."""

    def __init__(self, options: batching.BatchOptions, data: str, partitions: int, store: PartitionStore):
        self.options, self.data, self.partitions, self.store = options, data, partitions, store

    @keeps_input_errors
    def process(self, element):
        part, handles = element
        rejects = rec.Rejects()
        chunk = merged_records(self.store, handles["records"], rejects) if handles["records"] else None
        if len(rejects):
            yield beam.pvalue.TaggedOutput("rejects", rejects)
        if chunk is not None:  # the partition's part of DATA's graph, before the join and any content check
            yield beam.pvalue.TaggedOutput("digest", graph_digest(chunk.ids, chunk.offsets, chunk.users))
        selection = self.store.gather(handles["selection"])
        if not selection:
            return
        ids = pa.concat_arrays([s[0] for s in selection])
        copies = np.concatenate([s[1] for s in selection])
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
        partition = {
            "ids": chunk.ids,
            "copies": copies,
            "offsets": chunk.offsets,
            "users": users,
            "content": chunk.content,
            "record_keys": record_keys,
            "valid": valid,  # False: invalid content, sampled like any record but its rows left out
        }
        yield beam.pvalue.TaggedOutput(
            "partitions", (part, self.store.write_arrays(f"records-{part:05d}.store", partition))
        )
        record_of_incidence = np.repeat(np.arange(len(copies)), np.diff(chunk.offsets))
        destination = user_partition_of(users, self.partitions)
        yield from self.store.write_split(
            f"incidences-{part:05d}.store",
            destination,
            lambda mask: (users[mask], record_keys[record_of_incidence[mask]], copies[record_of_incidence[mask]]),
        )


@beam.typehints.with_input_types(tuple[int, Iterable[Slice]])
@beam.typehints.with_output_types(Sent)
class _NeighbourPairs(beam.DoFn):
    """Within a user partition: the (record, neighbour) pairs its users make, sent to the record's partition."""

    def __init__(self, partitions: int, store: PartitionStore):
        self.partitions, self.store = partitions, store

    def process(self, element):
        part, handles = element
        pieces = self.store.gather(handles)
        users = stack(pieces, 0)
        record_keys = stack(pieces, 1)
        copies = stack(pieces, 2)
        keys, first, local = np.unique(record_keys, return_index=True, return_inverse=True)
        for chunk_index, (owner, neighbour) in enumerate(sampling.neighbour_pairs(local.ravel(), users)):
            owner_keys, neighbour_keys, neighbour_copies = keys[owner], keys[neighbour], copies[first[neighbour]]
            destination = record_partition_of(owner_keys, self.partitions)
            yield from self.store.write_split(
                f"pairs-{part:05d}-{chunk_index:05d}.store",
                destination,
                lambda mask: (owner_keys[mask], neighbour_keys[mask], neighbour_copies[mask]),  # noqa: B023 (used now)
            )


def _neighbourhood_histogram(element, store: PartitionStore):
    """A record partition's units counted by |N(e)|, from the pairs its records' users formed."""
    _, handles = element
    pieces = store.gather(handles)
    sizes, units = sampling.neighbourhood_sizes_of_pairs(*(stack(pieces, i) for i in range(3)))
    values, counts = sampling.size_histogram(np.repeat(sizes, units))
    yield dict(zip(values.tolist(), counts.tolist()))


def _merged_content(described: list[tuple[int, dict]], store: PartitionStore) -> dict:
    """The content columns' description over all record partitions that write rows (of all where none
    does, as the local engine describes zero rows): a column whose shape differs between partitions
    is variable-length; one whose type differs is an error. A partition whose records are all left
    out (invalid content) would describe a list column from no rows as variable-length."""
    merged: dict = {}
    writing = [one for rows, one in described if rows] or [one for _, one in described]
    with keeping_input_errors(store.directory):
        for one in writing:
            for name, feature in one.items():
                seen = merged.setdefault(name, dict(feature))
                if seen["dtype"] != feature["dtype"]:
                    raise InputError(
                        f"content column {name!r} is {seen['dtype']} in some records and {feature['dtype']} in others"
                    )
                if seen["shape"] != feature["shape"]:
                    seen["shape"] = [None]
    return merged


@beam.typehints.with_input_types(Chunk, SelectionTable)
class JoinSelection(beam.PTransform):
    """(records, selection) -> stored joined record partitions (partition, handle); incidences
    (user partition, handle); the content's description; rejected rows; summary values; and one
    GraphDigest of the records' graph (all valid records, selected or not)."""

    def __init__(self, options: batching.BatchOptions, data: str, partitions: int, store: PartitionStore):
        super().__init__()
        self.options, self.data, self.partitions, self.store = options, data, partitions, store

    def expand(self, inputs):
        records, selection = inputs
        store, partitions = self.store, self.partitions
        joined = (
            {
                "records": records | "SplitRecords" >> beam.ParDo(SplitByRecordPartition(partitions, store)),
                "selection": selection | "SplitSelection" >> beam.ParDo(_SplitSelection(partitions, store)),
            }
            | "GroupRecordPartitions" >> beam.CoGroupByKey()
            | "Join"
            >> beam.ParDo(_JoinSelection(self.options, self.data, partitions, store)).with_outputs(
                "partitions", "content", "rejects", "stats", "digest", main="incidences"
            )
        )
        content = (
            joined.content
            | "ContentOfPartitions" >> beam.combiners.ToList()
            | "MergeContent" >> beam.Map(_merged_content, store)
        )
        digest = joined.digest | "GraphDigest" >> beam.CombineGlobally(_sum_digests)
        return joined.partitions, joined.incidences, content, joined.rejects, joined.stats, digest


def _sum_digests(parts: Iterable[GraphDigest]) -> GraphDigest:
    """Partial graph digests added up (the digest of no record for none)."""
    return sum(parts, EMPTY_GRAPH)


@beam.typehints.with_input_types(Sent)
class NeighbourhoodHistogram(beam.PTransform):
    """Incidences (user partition, handle) -> one {|N(e)|: units} histogram over all units (Alg. 3 line 1)."""

    def __init__(self, partitions: int, store: PartitionStore):
        super().__init__()
        self.partitions, self.store = partitions, store

    def expand(self, incidences):
        return (
            incidences
            | "GroupUserPartitions" >> beam.GroupByKey()
            | "NeighbourPairs" >> beam.ParDo(_NeighbourPairs(self.partitions, self.store))
            | "GroupPairsByRecord" >> beam.GroupByKey()
            | "CountByNeighbourhood" >> beam.FlatMap(_neighbourhood_histogram, self.store)
            | "MergeHistograms" >> beam.CombineGlobally(merge_counts)
        )
