"""Building both sides of Alg. 1 on partitions, as Beam steps.

Records are split into record partitions (by id hash) and user partitions (by user hash). A record
partition holds its records' keys and selection; a user partition holds its users' incidences, the
records' preference keys, and for routing which user partitions each record's other users are in.
"""

from __future__ import annotations

from typing import Any

import apache_beam as beam
import numpy as np
import pyarrow as pa

from beam_pipelines.bound_rounds import RecordState, SideStore, keep
from beam_pipelines.pipeline import Chunk, keeping_input_errors, keeps_input_errors, merged_records, stat
from beam_pipelines.record_chunks import RecordPartitions
from beam_pipelines.store import PartitionStore
from madp.core import records as rec
from madp.core import storage
from madp.core.bounding import Capacities, build_user_side, preference_keys
from madp.core.graph_digest import graph_digest
from madp.core.hashing import partition_of
from madp.core.routing import distinct_partitions, owned, partition_bits
from madp.core.selection import BoundOptions, alternate_runs, read_capacities


@beam.typehints.with_output_types(tuple[int, Any])
class _BuildRecordPartition(beam.DoFn):
    """Merge a record partition's chunks, reject duplicated ids, attach the partial selection."""

    def __init__(self, options: BoundOptions, partitions: int, store: SideStore, state_dir: str | None, new_pass: bool):
        self.options, self.partitions, self.store = options, partitions, store
        self.state_dir, self.new_pass = state_dir, new_pass

    @keeps_input_errors
    def process(self, element):
        part, paths = element
        rejects = rec.Rejects()
        chunk = merged_records(self.store, paths, rejects)
        if len(rejects):
            yield beam.pvalue.TaggedOutput("rejects", rejects)
            yield stat(f"rejected_{rec.DUPLICATE_ID}", len(rejects))
        yield stat("input_records", len(chunk))
        # The bounded graph's digest, summed over partitions like the counts (no Beam counter: not a count).
        for name, value in graph_digest(chunk.ids, chunk.offsets, chunk.users).to_counts().items():
            yield beam.pvalue.TaggedOutput("stats", (name, value))
        n = len(chunk)
        copies, in_pass = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=bool)
        if self.state_dir:
            saved = PartitionStore.read_arrays(storage.join(self.state_dir, f"state-{part:05d}.store"))
            if not np.array_equal(saved["keys"], chunk.keys):
                raise RuntimeError(f"partition {part}: input changed between pipeline runs")
            copies, in_pass = saved["copies"], saved["in_pass"] & (not self.new_pass)
        arity = chunk.arity
        keys = preference_keys(
            chunk.ids, arity, self.options.order, self.options.seed, chunk.weights, alternate_runs(self.options)
        )
        user_partition = partition_of(chunk.users, self.partitions) if len(chunk.users) else np.zeros(0, np.int64)
        record_of_incidence = np.repeat(np.arange(n), arity)
        offsets, user_partitions = distinct_partitions(arity, user_partition, self.partitions)
        self.store.write_arrays(f"records-{part:05d}-ids.store", {"ids": chunk.ids})
        state = RecordState(
            keys=chunk.keys,
            arity=arity,
            user_partition_offsets=offsets,
            user_partitions=user_partitions,
            copies=copies,
            in_pass=in_pass,
        )
        yield keep(part, self.store.create("records", part, state))
        coowners = partition_bits(np.repeat(np.arange(n), np.diff(offsets)), user_partitions, n, self.partitions)
        slices = {}
        for user_part in np.unique(user_partition):
            mine = user_partition == user_part
            records = record_of_incidence[mine]
            slices[int(user_part)] = {
                "users": chunk.users.filter(pa.array(mine)),
                "record_keys": chunk.keys[records],
                "order": tuple(k[records] for k in keys),
                "record_partition": part,
                "coowners": coowners[records],
                "selection": (copies[records], in_pass[records]) if self.state_dir else None,
            }
        for user_part, where in self.store.write_slices(f"incidences-from-records{part:05d}.store", slices).items():
            yield beam.pvalue.TaggedOutput("incidences", (user_part, where))


def _split_capacities(path: str, default: int, partitions: int):
    """Each capacity to the user partition of every user id it can match: its own typed id, or for a
    CSV text id both the string and (if it writes one canonically) the integer; the partition matches
    it to its users exactly (`Capacities.typed_as`)."""
    capacities = read_capacities(path, default)
    user_ids, values = capacities.listed
    routes = [user_ids]
    if capacities.text_ids:
        routes.append(capacities.typed_as(pa.int64()))
    mine = np.zeros((partitions, len(values)), dtype=np.bool_)
    for ids in routes:
        valid = ~ids.is_null().to_numpy(zero_copy_only=False)
        partition = partition_of(ids.filter(pa.array(valid)), partitions)
        mine[partition, np.flatnonzero(valid)] = True
    for part in range(partitions):
        yield (
            part,
            Capacities(
                default,
                user_ids.filter(pa.array(mine[part])),
                values[mine[part]],
                capacities.text_ids,
            ),
        )


def _build_user_partition(element, default: int, store: SideStore):
    with keeping_input_errors(store.directory):  # a capacity of the wrong id type
        part, grouped = element
        if not grouped["incidences"]:
            return  # capacities listed for users of no record
        chunks = [store.read_slice(where) for where in grouped["incidences"]]
        capacities = grouped["capacities"][0] if grouped["capacities"] else Capacities(default)
        record_keys, first, inc_record = np.unique(
            np.concatenate([c["record_keys"] for c in chunks]), return_index=True, return_inverse=True
        )
        per_record = lambda values: np.concatenate(values)[first]  # noqa: E731
        order = (per_record([c["order"][0] for c in chunks]), per_record([c["order"][1] for c in chunks]))
        record_partition = per_record([np.full(len(c["record_keys"]), c["record_partition"]) for c in chunks])
        if chunks[0]["selection"] is None:
            copies, in_pass = np.zeros(len(record_keys), np.int64), np.zeros(len(record_keys), bool)
        else:
            copies, in_pass = (per_record([c["selection"][i] for c in chunks]) for i in range(2))
        side = build_user_side(
            pa.concat_arrays([c["users"] for c in chunks]),
            inc_record.astype(np.int64),
            record_keys,
            order,
            capacities,
            copies,
            in_pass,
        )
        coowners = per_record([c["coowners"] for c in chunks])
        owner = owned(coowners, part)
        routing = store.write_arrays(
            f"users-{part:05d}-routing.store",
            {"record_partition": record_partition, "coowners": coowners, "owner": owner},
        )
        yield keep(part, (*store.create("users", part, side), routing))


@beam.typehints.with_input_types(Chunk)
class BuildSides(beam.PTransform):
    """(file index, RecordChunk) -> both sides' partitions (handles), with the partial selection of
    `state_dir` when a pipeline run continues the algorithm; rejected duplicated ids, and counts."""

    def __init__(self, options: BoundOptions, partitions: int, store: SideStore, state_dir: str | None, new_pass: bool):
        super().__init__()
        self.options, self.partitions, self.store = options, partitions, store
        self.state_dir, self.new_pass = state_dir, new_pass

    def expand(self, chunks):
        options, partitions, store = self.options, self.partitions, self.store
        built = (
            chunks
            | "RecordPartitions" >> RecordPartitions(partitions, store)
            | "BuildRecordPartitions"
            >> beam.ParDo(
                _BuildRecordPartition(options, partitions, store, self.state_dir, self.new_pass)
            ).with_outputs("incidences", "rejects", "stats", main="records")
        )
        capacities = (
            chunks.pipeline
            | "CapacitiesFile" >> beam.Create([options.capacities] if options.capacities else [])
            | "SplitCapacities" >> beam.FlatMap(_split_capacities, options.max_contributions, partitions)
        )
        users = (
            {"incidences": built.incidences, "capacities": capacities}
            | "GroupUserPartitions" >> beam.CoGroupByKey()
            | "BuildUserPartitions" >> beam.FlatMap(_build_user_partition, options.max_contributions, store)
        )
        return users, built.records, built.rejects, built.stats
