"""Building both sides of Alg. 1 on partitions, as Beam steps; the data travels as elements.

Records are grouped into record partitions by id hash, so that duplicated ids meet and are rejected.
A record partition keeps its records' ids for the end (`RecordPartition`, the selection is joined to
it after the rounds) and sends each incidence to the user partition of its user (by user hash), as
one `Incidences` batch per user partition. A user partition (`bound_rounds.UserPartition`) sorts its
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

import dataclasses
from typing import Any, ClassVar

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from madp.beam import files
from madp.beam.bound_rounds import NO_USERS, NarrowedWhenPickled, UserPartition, narrowed, round_stat
from madp.beam.pipeline import Chunk, keeping_input_errors, keeps_input_errors, merged_records, stat
from madp.beam.record_chunks import RecordPartitions
from madp.core import records as rec
from madp.core.bounding import (
    Capacities,
    build_user_side,
    certified_records,
    preference_keys,
    preference_rank_order,
)
from madp.core.columnar import Columnar
from madp.core.graph_digest import graph_digest
from madp.core.hashing import partition_of
from madp.core.routing import distinct_partitions, take_csr
from madp.core.selection import BoundOptions, alternate_runs, user_distribution_stats


@dataclasses.dataclass
class RecordPartition(NarrowedWhenPickled):
    """A record partition's records (keys sorted) and the selection of earlier pipeline runs."""

    part: int
    keys: np.ndarray
    ids: pa.Array
    arity: np.ndarray
    copies: np.ndarray  # selected so far
    in_pass: np.ndarray  # selected in the pass in progress

    WORKING_DTYPES: ClassVar[dict[str, type]] = {"keys": np.int64, "arity": np.int64, "copies": np.int64}


@dataclasses.dataclass
class Incidences(Columnar):
    """A record partition's incidences bound for one user partition: per incidence its user and
    record (an index into the per-record arrays), per record what the user partition keeps.

    Its integer arrays stay `narrowed` in memory, not only on the wire: a user partition's worker
    holds every batch sent to it (160 per user partition at 10M records) until it builds the
    partition, and narrow arrays take about half the bytes (4.9 MB instead of 8.9 per record
    partition of the skewed 10M graph). `build_user_partition` casts each field to its
    `WORKING_DTYPES` entry as it concatenates the batches."""

    users: pa.Array
    record: np.ndarray
    record_keys: np.ndarray
    arity: np.ndarray
    primary: np.ndarray
    tie: np.ndarray
    record_partition: int
    peer_offsets: np.ndarray  # CSR per record: the distinct user partitions of its users, ascending
    peers: np.ndarray
    copies: np.ndarray
    in_pass: np.ndarray
    dropped_users: pa.Array  # the distinct users of the incidences the certificate dropped here,
    dropped_counts: np.ndarray  # and how many each: they count in the input's statistics only

    WORKING_DTYPES: ClassVar[dict[str, type]] = {
        "record": np.int64,
        "record_keys": np.int64,
        "arity": np.int32,
        "peer_offsets": np.int64,
        "peers": np.int32,
        "copies": np.int64,
        "dropped_counts": np.int64,
    }

    def __post_init__(self) -> None:
        for name in self.WORKING_DTYPES:
            setattr(self, name, narrowed(getattr(self, name)))

    @property
    def nbytes(self) -> int:
        """The bytes of the arrays that travel."""
        return sum(v.nbytes for v in vars(self).values() if isinstance(v, (np.ndarray, pa.Array)))


def _concatenated(batches: list[Incidences], field: str) -> np.ndarray:
    """One field of every batch, end to end, in its working dtype."""
    return np.concatenate([getattr(b, field) for b in batches], dtype=Incidences.WORKING_DTYPES.get(field))


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
        rejects = rec.Rejects()
        chunk = merged_records(chunks, rejects)
        if len(rejects):
            yield beam.pvalue.TaggedOutput("rejects", rejects)
            yield stat(f"rejected_{rec.DUPLICATE_ID}", len(rejects))
        yield stat("input_records", len(chunk))
        # The bounded graph's digest, summed over partitions like the counts (no Beam counter: not a count).
        for name, value in graph_digest(chunk.ids, chunk.offsets, chunk.users).to_counts().items():
            yield beam.pvalue.TaggedOutput("stats", (name, value))
        n, arity = len(chunk), chunk.arity
        copies, in_pass = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=bool)
        if self.resume_from is not None:
            copies, in_pass = _saved_selection(self.resume_from, part, chunk.keys)
        yield part, RecordPartition(part, chunk.keys, chunk.ids, arity, copies, in_pass)
        primary, tie = preference_keys(
            chunk.ids, arity, self.options.order, self.options.seed, chunk.weights, alternate_runs(self.options)
        )
        record_of_incidence = np.repeat(np.arange(n), arity)
        dropped = np.zeros(n, dtype=bool)
        if not self.options.duplicates:
            dropped = self._certified(chunk, record_of_incidence, (primary, tie))
            yield stat("certified_dropped_records", int(dropped.sum()))
        user_partition = partition_of(chunk.users, self.partitions) if len(chunk.users) else NO_USERS
        peer_offsets, peers = distinct_partitions(arity, user_partition, self.partitions)
        for user_part in np.unique(user_partition):
            here = user_partition == user_part
            mine = here & ~dropped[record_of_incidence]
            records, record = np.unique(record_of_incidence[mine], return_inverse=True)
            offsets, their_peers = take_csr(peer_offsets, peers, records)
            counted = pc.value_counts(chunk.users.filter(pa.array(here & ~mine))).flatten()
            incidences = Incidences(
                users=chunk.users.filter(pa.array(mine)),
                record=record,
                record_keys=chunk.keys[records],
                arity=arity[records],
                primary=primary[records],
                tie=tie[records],
                record_partition=part,
                peer_offsets=offsets,
                peers=their_peers,
                copies=copies[records],
                in_pass=in_pass[records],
                dropped_users=counted[0],
                dropped_counts=counted[1].to_numpy(),
            )
            yield stat(round_stat(0, "shuffled_bytes"), incidences.nbytes)
            yield beam.pvalue.TaggedOutput("incidences", (int(user_part), incidences))

    def _certified(
        self, chunk: rec.RecordChunk, record_of_incidence: np.ndarray, order: tuple[np.ndarray, np.ndarray]
    ) -> np.ndarray:
        """The records of this partition that the saturation certificate rejects."""
        if not len(chunk.users):
            return np.zeros(len(chunk), dtype=bool)
        encoded = pc.dictionary_encode(chunk.users)
        rank = np.empty(len(chunk), np.int64)
        rank[preference_rank_order(*order, chunk.keys)] = np.arange(len(chunk))
        return certified_records(
            encoded.indices.to_numpy().astype(np.int64),
            record_of_incidence,
            rank,
            chunk.arity,
            self.capacities.lookup(encoded.dictionary),
        )


def _split_capacities(capacities: Capacities, partitions: int):
    """Each capacity to the user partition of every user id it can match: its own typed id, or for a
    CSV text id both the string and (if it writes one canonically) the integer; the partition matches
    it to its users exactly (`Capacities.typed_as`)."""
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
                capacities.default,
                user_ids.filter(pa.array(mine[part])),
                values[mine[part]],
                capacities.text_ids,
            ),
        )


def _concat_csr(batches: list[Incidences]) -> tuple[np.ndarray, np.ndarray]:
    base = np.cumsum([0] + [len(b.peers) for b in batches[:-1]])
    offsets = [b.peer_offsets[1:].astype(np.int64) + start for b, start in zip(batches, base)]
    return np.concatenate([[0], *offsets], dtype=np.int64), _concatenated(batches, "peers")


def build_user_partition(part: int, batches: list[Incidences], capacities: Capacities) -> UserPartition:
    """A user partition from the incidences its record partitions sent (each record comes from one)."""
    batches = sorted(batches, key=lambda b: b.record_partition)  # whatever order the runner delivered them in
    record_keys = _concatenated(batches, "record_keys")
    order = np.argsort(record_keys)
    rank = np.empty(len(order), np.int64)
    rank[order] = np.arange(len(order))
    base = np.cumsum([0] + [len(b.record_keys) for b in batches[:-1]])
    per_record = lambda field: _concatenated(batches, field)[order]  # noqa: E731
    side = build_user_side(
        pa.concat_arrays([b.users for b in batches]),
        rank[np.concatenate([b.record.astype(np.int64) + start for b, start in zip(batches, base)])],
        record_keys[order],
        (per_record("primary"), per_record("tie")),
        capacities,
        per_record("copies"),
        per_record("in_pass"),
    )
    record_partition = np.concatenate([np.full(len(b.record_keys), b.record_partition, np.int32) for b in batches])
    peer_offsets, peers = take_csr(*_concat_csr(batches), order)
    return UserPartition(part, side, per_record("arity"), record_partition[order], peer_offsets, peers)


def _input_degrees(batches: list[Incidences]) -> tuple[np.ndarray, int]:
    """(records per user in the input, users with no incidence left after the certificate) of the
    users of these batches: the incidences sent and the counts of those dropped."""
    users = pa.concat_arrays([b.users for b in batches] + [b.dropped_users for b in batches])
    counts = np.concatenate(
        [np.ones(len(b.users), np.int64) for b in batches] + [b.dropped_counts for b in batches], dtype=np.int64
    )
    encoded = pc.dictionary_encode(users)
    codes = encoded.indices.to_numpy().astype(np.int64)
    users_sent = len(np.unique(codes[: sum(len(b.users) for b in batches)]))
    degree = np.bincount(codes, weights=counts, minlength=len(encoded.dictionary)).astype(np.int64)
    return degree, len(degree) - users_sent


def _build_user_partition(element, default: int, errors_dir: str | None):
    with keeping_input_errors(errors_dir):  # a capacity of the wrong id type
        part, grouped = element
        batches = list(grouped["incidences"])
        if not batches:  # capacities listed for users of no record
            return
        degree, gone = _input_degrees(batches)
        yield stat("input_users", len(degree))
        for name, value in user_distribution_stats(degree, np.zeros(gone, np.int64)).items():
            yield beam.pvalue.TaggedOutput("stats", (name, value))  # gone: users all of whose records were dropped
        if sum(len(b.users) for b in batches):
            capacities = grouped["capacities"][0] if grouped["capacities"] else Capacities(default)
            state = build_user_partition(part, batches, capacities)
            yield beam.pvalue.TaggedOutput("counts", ("eligible", int(state.owned().sum())))
            yield beam.pvalue.TaggedOutput("counts", ("active", len(state.side.inc_record)))
            yield stat("built_incidences", len(state.side.inc_record))
            packed = state.packed()
            yield stat("max_user_partition_bytes", len(packed))  # the largest element of the rounds' state
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
        listed = [] if self.capacities is None else list(_split_capacities(self.capacities, partitions))
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
