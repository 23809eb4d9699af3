"""Building both sides of Alg. 1 on partitions, as Beam steps; the data travels as elements. The
building itself is `madp.core.bound_steps`' (`split_record_partition`, `build_user_partition`); a
step here reads its element (and the selection an earlier pipeline run saved), calls it and emits.

Records are grouped into record partitions by id hash, so that duplicated ids meet and are rejected.
A record partition keeps its records' ids for the end (`RecordPartition`, the selection is joined to
it after the rounds) and sends each incidence to the user partition of its user (by user hash), as
one `Incidences` batch per user partition. A user partition (`bound_steps.UserPartition`) sorts its
users' incidences by preference, matches their capacities, and keeps per record what routing needs.

Without duplicates, a record partition first drops the records that the saturation certificate
(`bounding.certified_records`) rejects on its own records: an owner has, in this partition alone,
as many records it owns alone earlier in its order as its capacity. So a user with many records (the
skewed graph's heaviest holds 3.5% of all incidences at 10M records) sends its user partition a few
incidences per record partition instead of all of them; of the dropped incidences only each user's
count travels, for the input's statistics. The user partitions reject the rest of the certificate's
records at the pass start (`bound_rounds.FirstSaturation`), as the local engine does, so both run
the same rounds.
"""

from __future__ import annotations

from typing import Any

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from madp.beam import files
from madp.beam.pipeline import Chunk, keeping_input_errors, keeps_input_errors, stat
from madp.beam.record_chunks import RecordPartitions
from madp.core.bound_steps import build_record_partition, build_user_partition, capacities_by_partition
from madp.core.bounding import Capacities
from madp.core.selection import BoundOptions


def state_path(state_dir: str, part: int) -> str:
    """Where a pipeline run leaves a record partition's selection for the next run to continue from."""
    return files.FileSystems.join(state_dir, f"state-{part:05d}.parquet")


def _saved_selection(state_dir: str, part: int, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The selection the last run left for this record partition; anything but what it wrote (its
    records, copies of at least 0) stops the run, since copies decide the users' capacity left."""
    path = state_path(state_dir, part)
    table = pq.read_table(pa.BufferReader(files.read_bytes(path)))
    if not np.array_equal(table["key"].to_numpy(), keys):
        raise RuntimeError(f"record partition {part}: the input changed between pipeline runs ({path})")
    copies = table["copies"].to_numpy()
    if (
        not (pa.types.is_integer(table["copies"].type) and pa.types.is_boolean(table["in_pass"].type))
        or (copies < 0).any()
    ):
        raise RuntimeError(f"{path}: not the selection the last pipeline run wrote")
    return copies.astype(np.int64), table["in_pass"].to_numpy(zero_copy_only=False)


@beam.typehints.with_output_types(tuple[int, Any])
class _BuildRecordPartition(beam.DoFn):
    """Merge a record partition's chunks, reject duplicated ids, attach the saved selection; without
    duplicates, drop the records the saturation certificate rejects on this partition's records; send
    each incidence of the others to its user partition."""

    def __init__(
        self,
        options: BoundOptions,
        partitions: int,
        capacities: Capacities,
        resume_from: str | None,
        errors_dir: str | None,
    ):
        self.options, self.partitions, self.capacities = options, partitions, capacities
        self.resume_from, self.errors_dir = resume_from, errors_dir

    @keeps_input_errors
    def process(self, element):
        part, chunks = element
        resume_from = self.resume_from
        saved = None if resume_from is None else lambda keys: _saved_selection(resume_from, part, keys)
        built = build_record_partition(part, chunks, self.options, self.partitions, self.capacities, saved)
        if len(built.rejects):
            yield beam.pvalue.TaggedOutput("rejects", built.rejects)
        yield from (stat(name, count) for name, count in built.counted.items())
        # The bounded graph's digest, summed over partitions like the counts (no Beam counter: not a count).
        yield from (beam.pvalue.TaggedOutput("stats", pair) for pair in built.distribution.items())
        yield part, built.split.records
        for user_part, incidences in built.split.incidences:
            yield beam.pvalue.TaggedOutput("incidences", (user_part, incidences))


def _build_user_partition(element, default: int, errors_dir: str | None):
    with keeping_input_errors(errors_dir):  # a capacity of the wrong id type
        part, grouped = element
        batches = list(grouped["incidences"])
        if not batches:  # capacities listed for users of no record
            return
        capacities = grouped["capacities"][0] if grouped["capacities"] else Capacities(default)
        built = build_user_partition(part, batches, capacities)
        for name, value in built.input_stats.items():
            yield beam.pvalue.TaggedOutput("stats", (name, value))  # with the users the certificate left no record
        packed = b"" if built.state is None else built.state.packed()
        yield from (stat(name, count) for name, count in built.counted(len(packed)).items())
        if built.state is not None:
            yield beam.pvalue.TaggedOutput("counts", ("eligible", int(built.state.owned().sum())))
            yield beam.pvalue.TaggedOutput("counts", ("active", built.state.incidences))
            yield part, packed


@beam.typehints.with_input_types(Chunk)
class BuildSides(beam.PTransform):
    """(file index, RecordChunk) -> user partitions (user partition, packed UserPartition), record partitions
    (record partition, RecordPartition), rejected duplicated ids, the state's counts ("eligible"
    records, "active" incidences) and stats; with the selection that an earlier pipeline run left in
    `resume_from` when this run continues the algorithm."""

    def __init__(
        self,
        options: BoundOptions,
        partitions: int,
        capacities: Capacities | None,
        resume_from: str | None,
        errors_dir: str | None,
    ):
        super().__init__()
        self.options, self.partitions, self.capacities = options, partitions, capacities
        self.resume_from, self.errors_dir = resume_from, errors_dir

    def expand(self, chunks):
        options, partitions = self.options, self.partitions
        built = (
            chunks
            | "RecordPartitions" >> RecordPartitions(partitions)
            | "BuildRecordPartitions"
            >> beam.ParDo(
                _BuildRecordPartition(
                    options,
                    partitions,
                    self.capacities or Capacities(options.max_contributions),
                    self.resume_from,
                    self.errors_dir,
                )
            ).with_outputs("incidences", "rejects", "stats", main="records")
        )
        listed = [] if self.capacities is None else list(capacities_by_partition(self.capacities, partitions))
        capacities = chunks.pipeline | "Capacities" >> beam.Create(listed)
        users = (
            {"incidences": built.incidences, "capacities": capacities}
            | "GroupUserPartitions" >> beam.CoGroupByKey()
            | "BuildUserPartitions"
            >> beam.FlatMap(_build_user_partition, options.max_contributions, self.errors_dir).with_outputs(
                "counts", "stats", main="users"
            )
        )
        stats = (built.stats, users.stats) | "BuildStats" >> beam.Flatten()
        return users.users, built.records, built.rejects, users.counts, stats
