"""The steps of b-min-sep Poisson sampling (Alg. 3) over a bound selection, one partition at a time:
each takes a partition's arrays (or the pieces other partitions sent it) and gives what goes to each
partition, keyed by it, with the counts. No engine type is in them: an engine that moves the
partitions (Beam's `madp.beam.batch_join` and `batch_sample`) unpacks its elements, calls the step
and emits what it gives; the local engine (`madp.engines.batch_local`), one partition of everything,
calls the same sampling and writing steps.

  selection shard  -> `split_selection`             -> SelectedIds by record partition
  record partition -> `madp.engines.batching.join_partition` -> JoinedPartition, Incidences by user partition
  user partition   -> `neighbour_pairs_by_record`   -> NeighbourPairs by record partition
  record partition -> `neighbourhood_histogram`     -> {|N(e)|: units} (Alg. 3 line 1; p is calibrated on it)
  record partition -> `sample_partition`            -> Samples, SampledIncidences by user partition (line 3)
  user partition   -> `block_users`                 -> excluded samples by record partition (line 4)
  record partition -> `survivors`, `rows_of_file`   -> FileRows by batch file (line 5, warm-up dropped)
  batch file       -> `gathered_file_rows`          -> one FileRows, written by `batch_files.write_batch_file`
  written file     -> `written_by_partition`        -> WrittenUsers by user partition, record keys by record partition
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa

from madp.core import batch_files, sampling
from madp.core.batch_files import Feature, FileRows, WrittenFile
from madp.core.columnar import Columnar
from madp.core.errors import InputError
from madp.core.hashing import partition_of
from madp.core.routing import split_rows
from madp.core.selection import selection_arrays


def user_partition_of(hashes: np.ndarray, partitions: int) -> np.ndarray:
    """The user partition of each user hash (uint64)."""
    return (hashes % np.uint64(partitions)).astype(np.int64)


def record_partition_of(record_keys: np.ndarray, partitions: int) -> np.ndarray:
    """The record partition of each record key (uint64): that of its id, as `partition_of` gives it."""
    return partition_of(record_keys.view(np.int64), partitions)


# --- the partitions and the messages between them --------------------------------------------------


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


@dataclasses.dataclass(frozen=True)
class Units(Columnar):
    """What the sampling needs of a joined record partition: its records' keys and copies (its
    units) and their users (CSR), without the ids and content that only the survivors' rows need."""

    record_keys: np.ndarray
    copies: np.ndarray
    offsets: np.ndarray
    users: np.ndarray


@dataclasses.dataclass(frozen=True)
class Samples(Columnar):
    """A record partition's sampled (unit, step) pairs: the record index and unit key of each."""

    record: np.ndarray
    keys: np.ndarray
    step: np.ndarray


@dataclasses.dataclass(frozen=True)
class SampledIncidences(Columnar):
    """(user, step) incidences of a record partition's samples, sent to the user's partition."""

    source: int  # the record partition the samples are of
    users: np.ndarray
    steps: np.ndarray
    samples: np.ndarray  # index of each incidence's sample among its partition's Samples


@dataclasses.dataclass(frozen=True)
class WrittenUsers(Columnar):
    """The (user, step) pairs of written rows, sent to the user's partition."""

    users: np.ndarray
    steps: np.ndarray


# --- the join --------------------------------------------------------------------------------------


def selection_source(shard: Any) -> str:
    """How errors name a selection shard: the path it was read from, or its index."""
    return shard if isinstance(shard, str) else f"selection shard {shard}"


def split_selection(shard: Any, table: pa.Table, partitions: int) -> list[tuple[int, SelectedIds]]:
    """A selection shard (`shard`: its index, or the path it was read from; `table`: id, copies) ->
    (record partition, its ids and copies) for each partition it has ids of: the selection's side
    of joining it to the records."""
    ids, copies = selection_arrays(table, selection_source(shard))
    destination = partition_of(ids, partitions) if len(ids) else np.zeros(0, np.int64)
    return [(part, SelectedIds(ids.take(pa.array(rows)), copies[rows])) for part, rows in split_rows(destination)]


def incidences_by_user_partition(joined: JoinedPartition, partitions: int) -> list[tuple[int, Incidences]]:
    """A joined record partition's (user, record) incidences, each with its record's key and copies,
    by the user's partition: where the users' neighbourhoods N(e) (Alg. 3 line 1) are formed."""
    record_of_incidence = np.repeat(np.arange(len(joined.copies)), np.diff(joined.offsets))
    routed = []
    for user_part, rows in split_rows(user_partition_of(joined.users, partitions)):
        record = record_of_incidence[rows]
        routed.append((user_part, Incidences(joined.users[rows], joined.record_keys[record], joined.copies[record])))
    return routed


def merged_content(described: Iterable[tuple[int, dict[str, Feature]]]) -> dict[str, Feature]:
    """The content columns' description over all record partitions (each (rows written, its
    description)) that write rows (of all where none does, as the local engine describes zero
    rows): a column whose shape differs between partitions is variable-length; one whose type
    differs is an error. A partition whose records are all left out (invalid content) would
    describe a list column from no rows as variable-length."""
    described = list(described)
    merged: dict[str, Feature] = {}
    writing = [one for rows, one in described if rows] or [one for _, one in described]
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


# --- |N(e)|, for p -----------------------------------------------------------------------------------


def neighbour_pairs_by_record(pieces: Iterable[Incidences], partitions: int) -> Iterator[tuple[int, NeighbourPairs]]:
    """Alg. 3 line 1 within a user partition: the (record, neighbour) pairs its users make (each
    record its own neighbour), by the record's partition, a chunk of pairs at a time
    (`sampling.neighbour_pairs`), so a partition of heavy users never holds all its pairs at once."""
    pieces = list(pieces)
    users = np.concatenate([p.users for p in pieces])
    record_keys = np.concatenate([p.record_keys for p in pieces])
    copies = np.concatenate([p.copies for p in pieces])
    keys, first, local = np.unique(record_keys, return_index=True, return_inverse=True)
    for owner, neighbour in sampling.neighbour_pairs(local.ravel(), users):
        owner_keys, neighbour_keys, neighbour_copies = keys[owner], keys[neighbour], copies[first[neighbour]]
        for part, rows in split_rows(record_partition_of(owner_keys, partitions)):
            yield part, NeighbourPairs(owner_keys[rows], neighbour_keys[rows], neighbour_copies[rows])


def neighbourhood_histogram(pieces: Iterable[NeighbourPairs]) -> dict[int, int]:
    """A record partition's units counted by |N(e)| (Alg. 3 line 1), from the pairs its records'
    users formed; the partitions' histograms add up to the one p is calibrated on."""
    pieces = list(pieces)
    sizes, units = sampling.neighbourhood_sizes_of_pairs(
        np.concatenate([p.owners for p in pieces]),
        np.concatenate([p.neighbours for p in pieces]),
        np.concatenate([p.neighbour_copies for p in pieces]),
    )
    values, counts = sampling.size_histogram(np.repeat(sizes, units))
    return dict(zip(values.tolist(), counts.tolist()))


def histogram_arrays(histogram: dict[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """The {|N(e)|: units} histogram as (sizes, counts), sizes increasing, as the kernels take it."""
    sizes = np.array(sorted(histogram), dtype=np.int64)
    return sizes, np.array([histogram[s] for s in sizes.tolist()], dtype=np.int64)


# --- sampling and exclusion ------------------------------------------------------------------------


def units_of(joined: JoinedPartition) -> Units:
    """The part of a joined record partition that the sampling waits on p with."""
    return Units(joined.record_keys, joined.copies, joined.offsets, joined.users)


def sampled_units(record_of_unit: np.ndarray, keys: np.ndarray, probability: float, steps: int) -> Samples:
    """Alg. 3 line 3: each unit (its record and key, `sampling.unit_keys`) sampled with probability
    p at each of `steps` steps; one sample per (unit, step), in unit order."""
    unit, step = sampling.sampled_steps(keys, probability, steps)
    return Samples(record_of_unit[unit], keys[unit], step)


def sample_incidences(offsets: np.ndarray, users: np.ndarray, samples: Samples) -> tuple[np.ndarray, ...]:
    """(user, step, sample) of each incidence of the samples (their records' users, CSR by
    `offsets`): what min-sep exclusion (Alg. 3 line 4) looks at."""
    owner, flat = batch_files.incidences_of(offsets, samples.record)
    return users[flat], samples.step[owner], owner


class SampledPartition(NamedTuple):
    """What `sample_partition` gives: the partition's samples (kept there), their incidences by user
    partition, and the counts."""

    samples: Samples
    incidences: list[tuple[int, SampledIncidences]]
    units: int  # units of the partition
    sampled_unit_steps: int  # (unit, step) samples, before exclusion


def sample_partition(source: int, units: Units, probability: float, steps: int, partitions: int) -> SampledPartition:
    """Alg. 3 line 3 for record partition `source`: its units sampled at each of `steps` steps
    (warm-up included); each sample's (user, step) incidences go to the user's partition."""
    record_of_unit, keys = sampling.unit_keys(units.record_keys, units.copies)
    samples = sampled_units(record_of_unit, keys, probability, steps)
    users, user_steps, owner = sample_incidences(units.offsets, units.users, samples)
    incidences = [
        (user_part, SampledIncidences(source, users[rows], user_steps[rows], owner[rows]))
        for user_part, rows in split_rows(user_partition_of(users, partitions))
    ]
    return SampledPartition(samples, incidences, len(keys), len(samples.step))


def block_users(pieces: Iterable[SampledIncidences], min_sep: int) -> list[tuple[int, np.ndarray]]:
    """Alg. 3 line 4 within a user partition: the samples whose users are blocked at their step
    (a participation less than `min_sep` steps after the user's previous one), as (record
    partition, indices of its excluded samples). The pieces are taken in record partition order,
    whatever order they came in."""
    pieces = sorted(pieces, key=lambda p: p.source)
    users = np.concatenate([p.users for p in pieces])
    steps = np.concatenate([p.steps for p in pieces])
    samples = np.concatenate([p.samples for p in pieces])
    source = np.concatenate([np.full(len(p.users), p.source, np.int64) for p in pieces])
    blocked = sampling.blocked_user_steps(users, steps, min_sep)
    excluded_samples, excluded_source = samples[blocked], source[blocked]
    return [(part, excluded_samples[rows]) for part, rows in split_rows(excluded_source)]


# --- survivors and their rows ------------------------------------------------------------------------


def writable_rows(valid: np.ndarray, record: np.ndarray) -> np.ndarray:
    """Which sampled rows (by record index) go into the batches: those of records with valid content,
    taken after sampling and exclusion and before truncation. A step then writes a subset of the
    units it sampled, so it is truncated no more often than if all were written, and the bound
    rho <= T Pr[Binomial(U, p) > B_max] (docs/concepts/min-sep-batching.md) still holds."""
    return valid[record]


class WrittenSamples(NamedTuple):
    """The surviving samples whose rows are written: after warm-up (steps counted from the first
    training step), of records with valid content, each with its batch file."""

    record: np.ndarray
    keys: np.ndarray
    step: np.ndarray
    file: np.ndarray


def written_samples(valid: np.ndarray, survivors: Samples, warm_up: int, steps: int, files: int) -> WrittenSamples:
    """The surviving samples that go into the batch files: the warm-up's `warm_up` steps dropped and
    the rows of records with invalid content left out (`writable_rows`), over `files` files of
    contiguous steps."""
    kept = (survivors.step >= warm_up) & writable_rows(valid, survivors.record)
    step = survivors.step[kept] - warm_up
    return WrittenSamples(
        survivors.record[kept], survivors.keys[kept], step, batch_files.file_of_step(step, steps, files)
    )


def rows_of_file(joined: JoinedPartition, written: WrittenSamples, file: int) -> FileRows:
    """The rows of batch file `file` that `written`'s samples of the partition make (unordered:
    `write_batch_file` orders, truncates and pads each step)."""
    return _rows_of(joined, written, np.flatnonzero(written.file == file))


def rows_of_steps(joined: JoinedPartition, written: WrittenSamples, steps: range) -> FileRows:
    """The rows of the training steps `steps`, a part of one batch file's range, that `written`'s samples
    of the partition make: `write_batch_file` writes of them the bytes those steps have in the whole file
    (a file's rows go in step order, each step truncated and padded on its own)."""
    return _rows_of(joined, written, np.flatnonzero((written.step >= steps.start) & (written.step < steps.stop)))


def _rows_of(joined: JoinedPartition, written: WrittenSamples, mine: np.ndarray) -> FileRows:
    return batch_files.file_rows(
        joined.ids,
        joined.content,
        joined.offsets,
        joined.users,
        joined.record_keys,
        written.record[mine],
        written.keys[mine],
        written.step[mine],
    )


class Survivors(NamedTuple):
    """What `survivors` gives for a record partition: its written samples and the counts."""

    written: WrittenSamples
    excluded: int  # samples excluded by min-sep
    sampled_sizes: np.ndarray  # surviving samples per sampled step (warm-up included), before truncation


def survivors(
    joined: JoinedPartition,
    samples: Samples,
    excluded: Iterable[np.ndarray],
    warm_up: int,
    steps: int,
    files: int,
) -> Survivors:
    """Alg. 3 line 5 for a record partition: its samples but those `block_users` excluded (indices,
    from each user partition); the survivors after warm-up go to their batch files (`rows_of_file`),
    but for the rows of records with invalid content (`--on-invalid skip`), which were sampled like any."""
    survive = np.ones(len(samples.step), dtype=bool)
    for indices in excluded:
        survive[indices] = False
    kept = Samples(samples.record[survive], samples.keys[survive], samples.step[survive])
    return Survivors(
        written_samples(joined.valid, kept, warm_up, steps, files),
        int((~survive).sum()),
        np.bincount(kept.step, minlength=warm_up + steps),
    )


def gathered_file_rows(by_partition: Iterable[tuple[int, FileRows]]) -> FileRows:
    """A batch file's rows from every record partition (record partition, its rows there), in
    partition order whatever order they came in, as one FileRows."""
    pieces = [rows for _, rows in sorted(by_partition, key=lambda item: item[0])]
    base = np.cumsum([0] + [int(p.user_offsets[-1]) for p in pieces[:-1]])
    return FileRows(
        steps=np.concatenate([p.steps for p in pieces]),
        unit_keys=np.concatenate([p.unit_keys for p in pieces]),
        record_keys=np.concatenate([p.record_keys for p in pieces]),
        ids=pa.concat_arrays([p.ids for p in pieces]),
        content=pa.concat_tables([p.content for p in pieces]),
        user_offsets=np.concatenate([[0]] + [p.user_offsets[1:] + b for p, b in zip(pieces, base)]).astype(np.int64),
        users=np.concatenate([p.users for p in pieces]),
    )


# --- what was written, for the report ------------------------------------------------------------


class WrittenRouting(NamedTuple):
    """A written batch file's rows, for the statistics over all files: their (user, step) pairs by
    user partition (participation) and their record keys by record partition (distinct records)."""

    users: list[tuple[int, WrittenUsers]]
    records: list[tuple[int, np.ndarray]]


def written_by_partition(result: WrittenFile, partitions: int) -> WrittenRouting:
    """A written batch file's (user, step) pairs and record keys, each sent to its partition, where
    each user's and each record's are counted once over all files."""
    users, user_steps, records = result.user_hashes, result.user_steps, result.record_keys
    return WrittenRouting(
        [
            (part, WrittenUsers(users[at], user_steps[at]))
            for part, at in split_rows(user_partition_of(users, partitions))
        ],
        [(part, records[at]) for part, at in split_rows(record_partition_of(records, partitions))],
    )


def written_record_count(keys: Sequence[np.ndarray]) -> int:
    """Distinct records among a record partition's written record keys (from every file)."""
    return len(np.unique(np.concatenate(list(keys))))
