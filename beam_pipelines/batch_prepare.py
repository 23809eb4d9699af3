"""Batching on Beam, first run: read DATA and the selection into record partitions, join them, store
each partition, and count the units by |N(e)| (Alg. 3 line 1) for the driver to calibrate p.

  files -> record partitions (join with the selection) -> user partitions (neighbour pairs)
        -> record partitions (|N(e)| per record) -> one histogram
"""

from __future__ import annotations

import apache_beam as beam
import numpy as np
import pyarrow as pa
from apache_beam.metrics import Metrics

from beam_pipelines.pipeline import by_kind, keeps_input_errors, merge_rejects, merged_records
from beam_pipelines.store import PartitionStore, stack
from madp.core import record_reading, sampling
from madp.core import records as rec
from madp.core.errors import InputError
from madp.core.hashing import partition_of
from madp.core.randomness import SecretKey
from madp.engines import batching
from madp.engines.batch_report import merge_counts

NAMESPACE = "madp.batch"


def count(name: str, value: int) -> None:
    """A Beam counter (retried bundles may inflate it; the report's figures come from the outputs)."""
    Metrics.counter(NAMESPACE, name).inc(int(value))


def user_partition_of(hashes: np.ndarray, partitions: int) -> np.ndarray:
    return (hashes % np.uint64(partitions)).astype(np.int64)


def summary_value(name: str, value) -> beam.pvalue.TaggedOutput:
    """A named value of any kind (a histogram, a file's counts, a partition's handle) for the driver's summary
    of the run; unlike `bound_rounds.stat`, no Beam counter."""
    return beam.pvalue.TaggedOutput("stats", (name, value))


def record_partition_of(record_keys: np.ndarray, partitions: int) -> np.ndarray:
    return partition_of(record_keys.view(np.int64), partitions)


class _ReadDataFile(beam.DoFn):
    def __init__(self, columns: rec.Columns, content: tuple[str, ...], partitions: int, store: PartitionStore):
        self.columns, self.content, self.partitions, self.store = columns, content, partitions, store

    @keeps_input_errors
    def process(self, element):
        index, path = element
        result = record_reading.read_file(path, index, self.columns, self.content)
        if len(result.rejects):
            yield beam.pvalue.TaggedOutput("rejects", result.rejects)
        chunk = result.chunk
        destination = partition_of(chunk.ids, self.partitions) if len(chunk) else np.zeros(0, np.int64)
        for part, handle in self.store.write_split(
            f"data-{index:06d}.store", destination, lambda mask: rec.take(chunk, mask)
        ):
            yield part, ("records", handle)


class _ReadSelectionFile(beam.DoFn):
    def __init__(self, partitions: int, store: PartitionStore):
        self.partitions, self.store = partitions, store

    @keeps_input_errors
    def process(self, element):
        index, path = element
        ids, copies = batching.read_selection_file(path)
        destination = partition_of(ids, self.partitions) if len(ids) else np.zeros(0, np.int64)
        for part, handle in self.store.write_split(
            f"selection-{index:06d}.store",
            destination,
            lambda mask: (ids.filter(pa.array(mask)), copies[mask]),
        ):
            yield part, ("selection", handle)


class _BuildRecordPartition(beam.DoFn):
    """Join a record partition with its selected ids; store it; send incidences to user partitions."""

    def __init__(self, data: str, key: SecretKey, on_invalid: str, partitions: int, store: PartitionStore):
        self.data, self.key, self.on_invalid, self.partitions, self.store = data, key, on_invalid, partitions, store

    @keeps_input_errors
    def process(self, element):
        part, values = element
        handles = by_kind(values)
        rejects = rec.Rejects()
        chunk = merged_records(self.store, handles["records"], rejects) if "records" in handles else None
        if len(rejects):
            yield beam.pvalue.TaggedOutput("rejects", rejects)
        selection = self.store.gather(handles.get("selection", []))
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
        if self.on_invalid == "skip":
            content_rejects = rec.Rejects()
            chunk, copies = batching.skip_invalid_content(chunk, copies, content_rejects)
            if len(content_rejects):
                yield beam.pvalue.TaggedOutput("rejects", content_rejects)
        yield summary_value("described", batching.check_content(chunk.content, chunk.ids))
        yield summary_value("records", len(copies))
        yield summary_value("id_type", chunk.ids.type)
        users = batching.user_hashes(chunk.users)
        record_keys = batching.record_hashes(chunk.ids, self.key)
        partition = {
            "ids": chunk.ids,
            "copies": copies,
            "offsets": chunk.offsets,
            "users": users,
            "content": chunk.content,
            "record_keys": record_keys,
        }
        yield summary_value("partition", (part, self.store.write_arrays(f"records-{part:05d}.store", partition)))
        record_of_incidence = np.repeat(np.arange(len(copies)), np.diff(chunk.offsets))
        destination = user_partition_of(users, self.partitions)
        yield from self.store.write_split(
            f"incidences-{part:05d}.store",
            destination,
            lambda mask: (users[mask], record_keys[record_of_incidence[mask]], copies[record_of_incidence[mask]]),
        )


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


class PreparePipeline(beam.PTransform):
    """Read, validate and join; store record partitions; histogram of |N(e)| over units."""

    def __init__(
        self,
        data_files: list[str],
        selection_files: list[str],
        data: str,
        content: tuple[str, ...],
        options: batching.BatchOptions,
        partitions: int,
        store: PartitionStore,
    ):
        super().__init__()
        self.data_files, self.selection_files, self.data, self.content = data_files, selection_files, data, content
        self.options, self.partitions, self.store = options, partitions, store

    def expand(self, pbegin):
        store, partitions = self.store, self.partitions
        read = (
            pbegin
            | "ListDataFiles" >> beam.Create(list(enumerate(self.data_files)))
            | "SpreadDataFiles" >> beam.Reshuffle()
            | "ReadAndValidate"
            >> beam.ParDo(_ReadDataFile(self.options.columns, self.content, partitions, store)).with_outputs(
                "rejects", main="records"
            )
        )
        selection = (
            pbegin
            | "ListSelectionFiles" >> beam.Create(list(enumerate(self.selection_files)))
            | "ReadSelection" >> beam.ParDo(_ReadSelectionFile(partitions, store))
        )
        built = (
            (read.records, selection)
            | "RecordsAndSelection" >> beam.Flatten()
            | "GroupRecordPartitions" >> beam.GroupByKey()
            | "JoinSelection"
            >> beam.ParDo(
                _BuildRecordPartition(self.data, self.options.key, self.options.on_invalid, partitions, store)
            ).with_outputs("stats", "rejects", main="incidences")
        )
        histogram = (
            built.incidences
            | "GroupUserPartitions" >> beam.GroupByKey()
            | "NeighbourPairs" >> beam.ParDo(_NeighbourPairs(partitions, store))
            | "GroupPairsByRecord" >> beam.GroupByKey()
            | "NeighbourhoodHistogram" >> beam.FlatMap(_neighbourhood_histogram, store)
            | "MergeHistograms" >> beam.CombineGlobally(merge_counts)
            | "NamedHistogram" >> beam.Map(lambda h: ("histogram", h))
        )
        rejects = (
            (read.rejects, built.rejects)
            | "AllRejects" >> beam.Flatten()
            | "MergeRejects" >> beam.CombineGlobally(merge_rejects)
            | "NamedRejects" >> beam.Map(lambda r: ("rejects", r))
        )
        return (
            (histogram, rejects, built.stats)
            | "PrepareSummary" >> beam.Flatten()
            | "CollectPrepare" >> beam.combiners.ToList()
            | "WritePrepare" >> beam.Map(lambda items: store.write_arrays("prepare-summary.store", items))
        )
