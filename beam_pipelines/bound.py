"""Contribution bounding as an Apache Beam pipeline: the `madp.bounding` kernels on partitions.

Records are split into `partitions` record partitions (by id hash) and user partitions (by
user hash); every element is a whole columnar partition, never a single record. Each round of
Alg. 1 is unrolled in the graph as three shuffles of messages (record keys):

  users --proposals--> records --accepted--> users --dead--> co-owners' user partitions

Partition arrays stay in a `PartitionStore` under OUTPUT/_work/; only handles and messages
travel through the graph. A pipeline run unrolls a block of rounds; the driver (`run_beam`)
chains runs until the algorithm converges, carrying the partial selection, and starts a new
pass over residual capacities for the with-duplicates variant.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import pickle
import re
import time
import uuid
from typing import Any

import apache_beam as beam
import numpy as np
import pyarrow as pa
from apache_beam.metrics import Metrics
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.options.pipeline_options import (
    DirectOptions,
    PipelineOptions,
    StandardOptions,
    TypeOptions,
    WorkerOptions,
)

from madp import records as rec
from madp import storage
from madp.bounding import (
    Capacities,
    UserSide,
    build_user_side,
    consume,
    local_mask,
    preference_keys,
    propose,
    retire,
    unanimous,
)
from madp.hashing import partition_of
from madp.selection import (
    BoundOptions,
    alternate_runs,
    base_report,
    group_sizes,
    handle_rejects,
    histograms,
    prepare_output,
    read_capacities,
    record_distribution_stats,
    selection_manifest,
    selection_shards,
    shard_path,
    sorted_selection,
    user_distribution_stats,
    write_report,
    write_selection_shard,
)

log = logging.getLogger("madp.bound")
NAMESPACE = "madp.bound"
WORK_DIR = "_work"
DEFAULT_PARTITIONS = 4
DEFAULT_ROUNDS_PER_PIPELINE = 6


@dataclasses.dataclass(frozen=True)
class RecordState:
    """A record partition's side of the algorithm (keys sorted)."""

    keys: np.ndarray
    arity: np.ndarray
    user_partition_offsets: np.ndarray  # CSR: distinct user partitions of each record
    user_partitions: np.ndarray
    copies: np.ndarray
    in_pass: np.ndarray


_CHANGING = {"users": ("eligible", "residual"), "records": ("copies", "in_pass")}


class PartitionStore:
    """Partition state kept in files under OUTPUT/_work/, so that only messages are shuffled.

    A handle (static path, changing path; for users also a routing path) travels with each
    partition through the graph. The static arrays are written once; the changing ones are
    written by each step that changes them, under a name unique to (pipeline run, side,
    partition, step), so a retried bundle rewrites identical content.
    """

    def __init__(self, directory: str):
        self.directory = directory

    def write_arrays(self, name: str, arrays: dict) -> str:
        path = storage.join(self.directory, name)
        with storage.open_output(path) as handle:
            handle.write(pickle.dumps(arrays, protocol=pickle.HIGHEST_PROTOCOL))
        return path

    @staticmethod
    def read_arrays(path: str) -> dict:
        with storage.open_input(path) as handle:
            return pickle.loads(handle.read())

    def write_slices(self, name: str, slices: dict[int, object]) -> dict[int, tuple[str, int, int]]:
        """One file per sender for a bulk exchange; each receiver gets (path, offset, length) of its slice."""
        blobs = {
            destination: pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
            for destination, payload in slices.items()
        }
        path, offset, where = storage.join(self.directory, name), 0, {}
        with storage.open_output(path) as handle:
            for destination, blob in blobs.items():
                handle.write(blob)
                where[destination] = (path, offset, len(blob))
                offset += len(blob)
        return where

    @staticmethod
    def read_slice(where: tuple[str, int, int]):
        path, offset, length = where
        with storage.open_input(path) as handle:
            return pickle.loads(handle.read_at(length, offset))

    def create(self, side: str, part: int, state) -> tuple[str, str]:
        arrays = dataclasses.asdict(state)
        static = {k: v for k, v in arrays.items() if k not in _CHANGING[side]}
        return (self.write_arrays(f"{side}-{part:05d}-static.pkl", static), self.update(side, part, "built", state))

    def update(self, side: str, part: int, step: str, state) -> str:
        return self.write_arrays(f"{side}-{part:05d}-{step}.pkl", {k: getattr(state, k) for k in _CHANGING[side]})

    def load(self, side: str, handle: tuple[str, ...]):
        arrays = {**_read_static(handle[0]), **self.read_arrays(handle[1])}
        return UserSide(**arrays) if side == "users" else RecordState(**arrays)


@functools.lru_cache(maxsize=8)
def _read_static(path: str) -> dict:
    """Static arrays are immutable once written: each worker reads a partition's once, read-only."""
    arrays = PartitionStore.read_arrays(path)
    for array in arrays.values():
        array.flags.writeable = False
    return arrays


def _split(keys: np.ndarray, partition: np.ndarray):
    """(partition, keys) for each partition present."""
    order = np.argsort(partition, kind="stable")
    parts, starts = np.unique(partition[order], return_index=True)
    for part, chunk in zip(parts, np.split(keys[order], starts[1:])):
        yield int(part), chunk


def _partition_bits(rows: np.ndarray, partitions: np.ndarray, n: int, num_partitions: int) -> np.ndarray:
    """Per row, the set of partitions as a bitmask: n x ceil(P/64) uint64 words."""
    bits = np.zeros((n, (num_partitions + 63) // 64), dtype=np.uint64)
    np.bitwise_or.at(bits, (rows, partitions // 64), np.left_shift(np.uint64(1), (partitions % 64).astype(np.uint64)))
    return bits


def _bits_below(partition: int, words: int) -> np.ndarray:
    """Bitmask (one row of words) of the partitions numbered below `partition`."""
    mask = np.zeros(words, dtype=np.uint64)
    mask[: partition // 64] = np.uint64(0xFFFFFFFFFFFFFFFF)
    if partition % 64:
        mask[partition // 64] = np.uint64((1 << (partition % 64)) - 1)
    return mask


def _set_bits(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row, partition) for every set bit of a bitmask matrix."""
    rows, partitions = [], []
    for word in range(bits.shape[1]):
        values = bits[:, word].copy()
        index = np.flatnonzero(values)
        while len(index):
            lowest = values[index] & (~values[index] + np.uint64(1))
            rows.append(index)
            partitions.append(64 * word + np.log2(lowest.astype(np.float64)).astype(np.int64))
            values[index] ^= lowest
            index = index[values[index] != 0]
    if not rows:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(rows), np.concatenate(partitions)


def _stat(name: str, value: int) -> beam.pvalue.TaggedOutput:
    """A count for the run's summary, also reported as a Beam counter (which retries may inflate)."""
    if not name.startswith("max_"):
        Metrics.counter(NAMESPACE, name).inc(int(value))
    return beam.pvalue.TaggedOutput("stats", (name, int(value)))


def _round_stat(round_index: int, what: str) -> str:
    return f"round_{round_index:05d}_{what}"


STATE = "state"


def _send(tag: str, destination: int, keys: np.ndarray) -> beam.pvalue.TaggedOutput:
    """A message to a partition, tagged with its kind for the join at the destination."""
    return beam.pvalue.TaggedOutput(tag, (destination, (tag, keys)))


def _keep(part: int, state) -> tuple:
    return part, (STATE, state)


def _by_kind(values) -> dict:
    grouped: dict = {}
    for kind, value in values:
        grouped.setdefault(kind, []).append(value)
    return grouped


def _messages(grouped: dict, tag: str) -> np.ndarray:
    return np.concatenate(grouped[tag]) if tag in grouped else np.zeros(0, np.int64)


# --- reading and building the two sides ---------------------------------------------------------


@beam.typehints.with_output_types(tuple[int, Any])
class _ReadFile(beam.DoFn):
    """Read and validate one input file; hand its records to their record partitions."""

    def __init__(self, columns: rec.Columns, partitions: int, store: PartitionStore):
        self.columns, self.partitions, self.store = columns, partitions, store

    def process(self, element):
        index, path = element
        result = rec.read_file(path, index, self.columns)
        yield _stat("input_rows", result.rows_read)
        yield from (_stat(f"rejected_{reason}", count) for reason, count in result.rejects.counts().items())
        yield _stat("repeated_users_removed", result.repeated_users_removed)
        if len(result.rejects):
            yield beam.pvalue.TaggedOutput("rejects", result.rejects)
        partition = partition_of(result.chunk.ids, self.partitions) if len(result.chunk) else np.zeros(0, np.int64)
        slices = {int(part): rec.take(result.chunk, partition == part) for part in np.unique(partition)}
        yield from self.store.write_slices(f"chunks-from-file{index:06d}.pkl", slices).items()


@beam.typehints.with_output_types(tuple[int, Any])
class _BuildRecordPartition(beam.DoFn):
    """Merge a record partition's chunks, reject duplicated ids, attach the partial selection."""

    def __init__(
        self, options: BoundOptions, partitions: int, store: PartitionStore, state_dir: str | None, new_pass: bool
    ):
        self.options, self.partitions, self.store = options, partitions, store
        self.state_dir, self.new_pass = state_dir, new_pass

    def process(self, element):
        part, paths = element
        chunks = sorted(map(self.store.read_slice, paths), key=lambda c: int(c.keys[0]))
        rejects = rec.Rejects()
        chunk = rec.reject_duplicates(rec.merge_chunks(chunks), rejects)
        if len(rejects):
            yield beam.pvalue.TaggedOutput("rejects", rejects)
            yield _stat(f"rejected_{rec.DUPLICATE_ID}", len(rejects))
        yield _stat("input_records", len(chunk))
        n = len(chunk)
        copies, in_pass = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=bool)
        if self.state_dir:
            saved = PartitionStore.read_arrays(storage.join(self.state_dir, f"state-{part:05d}.pkl"))
            if not np.array_equal(saved["keys"], chunk.keys):
                raise RuntimeError(f"partition {part}: input changed between pipeline runs")
            copies, in_pass = saved["copies"], saved["in_pass"] & (not self.new_pass)
        arity = chunk.arity
        keys = preference_keys(
            chunk.ids, arity, self.options.order, self.options.seed, chunk.weights, alternate_runs(self.options)
        )
        user_partition = partition_of(chunk.users, self.partitions) if len(chunk.users) else np.zeros(0, np.int64)
        record_of_incidence = np.repeat(np.arange(n), arity)
        pairs = np.sort(record_of_incidence * self.partitions + user_partition)
        # Sort and mask: numpy 2's hash-based np.unique is ~25x slower on these many distinct values.
        pairs = pairs[np.concatenate([[True], pairs[1:] != pairs[:-1]])[: len(pairs)]]  # a partition may be empty
        offsets = np.concatenate([[0], np.cumsum(np.bincount(pairs // self.partitions, minlength=n))]).astype(np.int64)
        self.store.write_arrays(f"records-{part:05d}-ids.pkl", {"ids": chunk.ids})
        state = RecordState(
            keys=chunk.keys,
            arity=arity,
            user_partition_offsets=offsets,
            user_partitions=pairs % self.partitions,
            copies=copies,
            in_pass=in_pass,
        )
        yield _keep(part, self.store.create("records", part, state))
        coowners = _partition_bits(pairs // self.partitions, pairs % self.partitions, n, self.partitions)
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
        for user_part, where in self.store.write_slices(f"incidences-from-records{part:05d}.pkl", slices).items():
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


def _build_user_partition(element, default: int, store: PartitionStore):
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
    owner = ~np.any(coowners & _bits_below(part, coowners.shape[1]), axis=1)
    routing = store.write_arrays(
        f"users-{part:05d}-routing.pkl", {"record_partition": record_partition, "coowners": coowners, "owner": owner}
    )
    yield _keep(part, (*store.create("users", part, side), routing))


# --- the steps of a round: each joins a partition's handle with its messages ---------------------


@beam.typehints.with_output_types(tuple[int, Any])
class _Propose(beam.DoFn):
    def __init__(self, store: PartitionStore):
        self.store = store

    def process(self, element):
        part, (_, handle) = element
        side, routing = self.store.load("users", handle), _read_static(handle[2])
        index = side.inc_record[propose(side)]
        for record_part, keys in _split(side.record_keys[index], routing["record_partition"][index]):
            yield _send("proposals", record_part, keys)
        yield element


@beam.typehints.with_output_types(tuple[int, Any])
class _JoinedStep(beam.DoFn):
    """A step of round `round_index`: one partition's state, joined with the messages sent to it."""

    def __init__(self, store: PartitionStore, round_index: int):
        self.store, self.round_index = store, round_index

    def process(self, element):
        part, grouped = element[0], _by_kind(element[1])
        (state,) = grouped.pop(STATE)
        yield from self.step(part, state, grouped)

    def saved(self, side: str, part: int, static: str, state, step: str) -> tuple[str, str]:
        return static, self.store.update(side, part, f"r{self.round_index:05d}-{step}", state)

    def step(self, part: int, state, messages: dict):
        raise NotImplementedError


class _Select(_JoinedStep):
    """Record side: select the records proposed by all their users; tell those users."""

    def step(self, part, handle, messages):
        state = self.store.load("records", handle)
        accepted = unanimous(np.searchsorted(state.keys, _messages(messages, "proposals")), state.arity)
        yield _stat(_round_stat(self.round_index, "selected"), accepted.sum())
        if accepted.any():
            state = dataclasses.replace(state, copies=state.copies + accepted, in_pass=state.in_pass | accepted)
            handle = self.saved("records", part, handle[0], state, "selected")
            yield from _notify_users(state, accepted, "accepted")
        yield _keep(part, handle)


def _notify_users(state: RecordState, records: np.ndarray, tag: str):
    index = np.flatnonzero(records)
    counts = np.diff(state.user_partition_offsets)[index]
    positions = np.repeat(state.user_partition_offsets[index], counts) + (
        np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    )
    for user_part, keys in _split(np.repeat(state.keys[index], counts), state.user_partitions[positions]):
        yield _send(tag, user_part, keys)


class _Consume(_JoinedStep):
    """User side: take the accepted records; retire the records its saturated users kill, here and
    (by message) in the co-owners' user partitions."""

    def step(self, part, handle, messages):
        side, routing = self.store.load("users", handle), _read_static(handle[2])
        before = side.eligible.sum()
        dead = consume(side, local_mask(side.record_keys, _messages(messages, "accepted")))
        retire(side, dead)
        rows, partitions = _set_bits(routing["coowners"][dead])
        elsewhere = partitions != part
        for user_part, keys in _split(side.record_keys[dead][rows[elsewhere]], partitions[elsewhere]):
            yield _send("dead", user_part, keys)
        if side.eligible.sum() != before:
            handle = (*self.saved("users", part, handle[0], side, "consumed"), handle[2])
        yield _keep(part, handle)


class _Retire(_JoinedStep):
    """User side: retire the records that saturation killed elsewhere; count the eligible records
    this partition owns (lowest user partition among a record's users)."""

    def step(self, part, handle, messages):
        side, routing = self.store.load("users", handle), _read_static(handle[2])
        if "dead" in messages:
            retire(side, local_mask(side.record_keys, _messages(messages, "dead")))
            handle = (*self.saved("users", part, handle[0], side, "retired"), handle[2])
        eligible_records = np.bincount(side.inc_record[side.eligible], minlength=len(side.record_keys)) > 0
        yield _stat(_round_stat(self.round_index, "eligible"), (eligible_records & routing["owner"]).sum())
        yield _keep(part, handle)


class _Step(beam.PTransform):
    """Join a partition's handle with the messages sent to it and apply one step.

    States and messages arrive tagged by their producers, so the join is a Flatten and a
    GroupByKey (a CoGroupByKey would add five transforms per step to a graph of hundreds).
    """

    def __init__(self, step: beam.DoFn, outputs: tuple[str, ...]):
        super().__init__()
        self.step, self.outputs = step, outputs

    def expand(self, inputs):
        return (
            inputs
            | "Meet" >> beam.Flatten()
            | "Join" >> beam.GroupByKey()
            | "Apply" >> beam.ParDo(self.step).with_outputs(*self.outputs, main=STATE)
        )


class Saturate(beam.PTransform):
    """Alg. 1 lines 9-13: users take accepted records; records of saturated users leave E everywhere."""

    def __init__(self, store: PartitionStore, round_index: int):
        super().__init__()
        self.store, self.round_index = store, round_index

    def expand(self, inputs):
        users, accepted = inputs
        consumed = (users, accepted) | "UsersTakeAccepted" >> _Step(_Consume(self.store, self.round_index), ("dead",))
        retired = (consumed.state, consumed.dead) | "CoOwnersRetireDead" >> _Step(
            _Retire(self.store, self.round_index), ("stats",)
        )
        return retired.state, retired.stats


class ProposalRound(beam.PTransform):
    """One round of Alg. 1: proposals, unanimous selection, saturation."""

    def __init__(self, store: PartitionStore, round_index: int):
        super().__init__()
        self.store, self.round_index = store, round_index

    def expand(self, inputs):
        users, records = inputs
        proposed = users | "UsersPropose" >> beam.ParDo(_Propose(self.store)).with_outputs("proposals", main="state")
        selected = (records, proposed.proposals) | "RecordsSelectUnanimous" >> _Step(
            _Select(self.store, self.round_index), ("accepted", "stats")
        )
        users, death_stats = (proposed.state, selected.accepted) | "Saturate" >> Saturate(self.store, self.round_index)
        return users, selected.state, (selected.stats, death_stats)


# --- outputs ------------------------------------------------------------------------------------


@beam.typehints.with_output_types(tuple[int, Any])
class _FinishRecords(beam.DoFn):
    """Save the partial selection for a following pipeline run; emit selection shards and counts."""

    def __init__(self, store: PartitionStore, state_dir: str, shards: int):
        self.store, self.state_dir, self.shards = store, state_dir, shards

    def process(self, element):
        part, (_, handle) = element
        state = self.store.load("records", handle)
        PartitionStore(self.state_dir).write_arrays(
            f"state-{part:05d}.pkl", {"keys": state.keys, "copies": state.copies, "in_pass": state.in_pass}
        )
        yield _stat("selected_records", state.copies.sum())
        yield _stat("distinct_selected", (state.copies > 0).sum())
        for name, count in record_distribution_stats(state.arity, state.copies).items():
            yield beam.pvalue.TaggedOutput("stats", (name, count))  # summed into histograms; no Beam counter each
        selected = state.copies > 0
        ids = self.store.read_arrays(storage.join(self.store.directory, f"records-{part:05d}-ids.pkl"))["ids"]
        # Empty tables too: they carry the id type, so a shard no partition fills is still typed right.
        yield from selection_shards(ids.filter(pa.array(selected)), state.copies[selected], self.shards).items()


def _user_stats(element, store: PartitionStore):
    _, (_, handle) = element
    side = store.load("users", handle)
    Metrics.counter(NAMESPACE, "input_users").inc(len(side.residual))
    Metrics.distribution(NAMESPACE, "user_contribution").update(int(side.contribution.max(initial=0)))
    yield "input_users", len(side.residual)
    yield "max_user_contribution", int(side.contribution.max(initial=0))
    yield from user_distribution_stats(
        np.bincount(side.inc_user, minlength=len(side.residual)), side.contribution
    ).items()


def _write_shard(element, output: str, shards: int):
    shard, tables = element
    table = pa.concat_tables(tables)
    write_selection_shard(
        shard_path(output, shard, shards), sorted_selection(table["id"].combine_chunks(), table["copies"].to_numpy())
    )


def _aggregate_stats(element):
    name, values = element
    return name, (max(values) if name.startswith("max_") else sum(values))


def _merge_rejects(batches) -> rec.Rejects:
    merged = rec.Rejects()
    for batch in batches:
        merged.extend(batch)
    return merged


class BoundPipeline(beam.PTransform):
    """Read records, build both sides, run `rounds` unrolled rounds, write selection and state."""

    def __init__(
        self,
        files: list[str],
        output: str,
        options: BoundOptions,
        partitions: int,
        rounds: int,
        run_name: str,
        continues: bool,
        new_pass: bool,
    ):
        super().__init__()
        self.files, self.output, self.options, self.partitions = files, output, options, partitions
        self.rounds, self.run_name, self.continues, self.new_pass = rounds, run_name, continues, new_pass

    def expand(self, pbegin):
        work = storage.join(self.output, WORK_DIR)
        store = PartitionStore(storage.join(work, self.run_name))
        state_dir = storage.join(work, "state")
        read = (
            pbegin
            | "ListFiles" >> beam.Create(list(enumerate(self.files)))
            | "SpreadFiles" >> beam.Reshuffle()
            | "ReadAndValidate"
            >> beam.ParDo(_ReadFile(self.options.columns, self.partitions, store)).with_outputs(
                "rejects", "stats", main="chunks"
            )
        )
        built = (
            read.chunks
            | "GroupRecordPartitions" >> beam.GroupByKey()
            | "BuildRecordPartitions"
            >> beam.ParDo(
                _BuildRecordPartition(
                    self.options, self.partitions, store, state_dir if self.continues else None, self.new_pass
                )
            ).with_outputs("incidences", "rejects", "stats", main="records")
        )
        capacities = (
            pbegin
            | "CapacitiesFile" >> beam.Create([self.options.capacities] if self.options.capacities else [])
            | "SplitCapacities" >> beam.FlatMap(_split_capacities, self.options.max_contributions, self.partitions)
        )
        users = (
            {"incidences": built.incidences, "capacities": capacities}
            | "GroupUserPartitions" >> beam.CoGroupByKey()
            | "BuildUserPartitions" >> beam.FlatMap(_build_user_partition, self.options.max_contributions, store)
        )
        no_messages = pbegin | "NoAcceptedYet" >> beam.Create([])
        users, setup_stats = (users, no_messages) | "SaturateInitially" >> Saturate(store, 0)
        records = built.records
        stats = [read.stats, built.stats, setup_stats]
        for round_index in range(1, self.rounds + 1):
            users, records, round_stats = (users, records) | f"Round{round_index}" >> ProposalRound(store, round_index)
            stats.extend(round_stats)
        stats.append(users | "UserStats" >> beam.FlatMap(_user_stats, store))
        finished = records | "FinishRecords" >> beam.ParDo(
            _FinishRecords(store, state_dir, self.options.output_shards)
        ).with_outputs("stats", main="shards")
        stats.append(finished.stats)
        _ = (
            finished.shards
            | "GroupShards" >> beam.GroupByKey()
            | "WriteShards" >> beam.Map(_write_shard, self.output, self.options.output_shards)
        )
        _ = (
            (read.rejects, built.rejects)
            | "AllRejects" >> beam.Flatten()
            | "MergeRejects" >> beam.CombineGlobally(_merge_rejects)
            | "WriteRejects"
            >> beam.Map(lambda r: storage.write_text(storage.join(work, "rejected.jsonl"), r.to_jsonl()))
        )
        return (
            stats
            | "AllStats" >> beam.Flatten()
            | "GroupStats" >> beam.GroupByKey()
            | "AggregateStats" >> beam.Map(_aggregate_stats)
            | "CollectStats" >> beam.combiners.ToList()
            | "WriteSummary"
            >> beam.Map(
                lambda stats: storage.write_text(
                    storage.join(work, "summary.json"), json.dumps(dict(stats), sort_keys=True)
                )
            )
        )


class GroupSizes(beam.PTransform):
    """--order alternate: records with at most u users and with more, counted as the bounding sees
    them (valid rows, duplicated ids rejected within their id partition), written to `path`."""

    def __init__(self, files: list[str], options: BoundOptions, partitions: int, store: PartitionStore, path: str):
        super().__init__()
        self.files, self.options, self.partitions, self.store, self.path = files, options, partitions, store, path

    def expand(self, pbegin):
        threshold, store, path = self.options.arity_threshold, self.store, self.path
        read = (
            pbegin
            | "ListFiles" >> beam.Create(list(enumerate(self.files)))
            | "SpreadFiles" >> beam.Reshuffle()
            | "ReadAndValidate"
            >> beam.ParDo(_ReadFile(self.options.columns, self.partitions, store)).with_outputs(
                "rejects", "stats", main="chunks"
            )
        )
        return (
            read.chunks
            | "GroupRecordPartitions" >> beam.GroupByKey()
            | "CountGroups"
            >> beam.MapTuple(
                lambda part, paths: group_sizes(
                    rec.reject_duplicates(
                        rec.merge_chunks(sorted(map(store.read_slice, paths), key=lambda c: int(c.keys[0]))),
                        rec.Rejects(),
                    ).arity,
                    threshold,
                )
            )
            | "Total" >> beam.CombineGlobally(lambda sizes: tuple(map(sum, zip(*sizes))) if sizes else (0, 0))
            | "WriteSizes" >> beam.Map(lambda sizes: storage.write_text(path, json.dumps(list(sizes))))
        )


def _raise_input_error_in(error: Exception) -> None:
    """Raise the InputError a worker raised, which the runner wrapped in `error`, if there is one."""
    found = re.search(r"InputError: (.+?)(?: \[while running|\n|$)", str(error))
    if found:
        raise rec.InputError(found.group(1)) from error


def _counters(result, namespace: str = NAMESPACE) -> dict[str, int]:
    """A namespace's Beam counters of a finished run (committed values where the runner has them)."""
    found = result.metrics().query(MetricsFilter().with_namespace(namespace))["counters"]
    return {c.key.metric.name: int(c.committed if c.committed is not None else c.attempted) for c in found}


def unknown_beam_args(beam_args: list[str]) -> list[str]:
    """The flags among `beam_args` that no Beam pipeline option defines (Beam would drop them silently)."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    seen, classes = set(), [PipelineOptions]
    while classes:
        cls = classes.pop()
        if cls not in seen:
            seen.add(cls)
            classes.extend(cls.__subclasses__())
            if "_add_argparse_args" in vars(cls):
                try:
                    cls._add_argparse_args(parser)  # type: ignore[arg-type]  # Beam's wrapper of this parser
                except argparse.ArgumentError:
                    pass  # an option two classes define: the first one suffices here
    _, unknown = parser.parse_known_args(beam_args)
    return [arg for arg in unknown if arg.startswith("-")]


def pipeline_options(beam_args: list[str]) -> PipelineOptions:
    """The user's Beam options, with our defaults where the user set none; a flag that is neither a
    madp option nor a Beam option (a typo such as --min_sep) is an error, not silently dropped."""
    unknown = unknown_beam_args(beam_args)
    if unknown:
        raise rec.InputError(
            f"unrecognized option(s) {' '.join(unknown)}: neither an option of this command "
            f"nor a Beam pipeline option (check the spelling: madp options use dashes)"
        )
    options = PipelineOptions(beam_args)
    explicit = options.get_all_options(drop_default=True)
    if "pipeline_type_check" not in explicit:
        # Hundreds of transforms: introspecting each one's type hints costs seconds per run.
        options.view_as(TypeOptions).pipeline_type_check = False
    if options.view_as(StandardOptions).runner in (None, "DirectRunner"):
        options.view_as(StandardOptions).runner = "DirectRunner"
        direct = options.view_as(DirectOptions)
        if "direct_running_mode" not in explicit:
            direct.direct_running_mode = "multi_processing"
        if "direct_num_workers" not in explicit:
            direct.direct_num_workers = 2
        if "default_sdk_harness_log_level" not in explicit:
            options.view_as(WorkerOptions).default_sdk_harness_log_level = "WARNING"
    return options


def _count_groups(files: list[str], options: BoundOptions, partitions: int, beam_options, work: str) -> BoundOptions:
    """One pipeline run that counts the two groups of --order alternate (their sizes place the runs)."""
    path = storage.join(work, "group-sizes.json")
    pipeline = beam.Pipeline(options=beam_options)
    _ = pipeline | "CountGroups" >> GroupSizes(
        files, options, partitions, PartitionStore(storage.join(work, "group-sizes")), path
    )
    try:
        pipeline.run().wait_until_finish()
    except Exception as error:
        _raise_input_error_in(error)
        raise
    small, large = json.loads(storage.read_text(path))
    log.info("--order alternate: %d records with at most %d users, %d with more", small, options.arity_threshold, large)
    return dataclasses.replace(options, group_sizes=(small, large))


def run_beam(
    input_path: str,
    output: str,
    options: BoundOptions,
    beam_args: list[str],
    partitions: int = DEFAULT_PARTITIONS,
    rounds_per_pipeline: int = DEFAULT_ROUNDS_PER_PIPELINE,
) -> dict:
    """`madp bound --runner <Beam runner>`: chain pipeline runs until the algorithm converges."""
    if partitions < 1 or rounds_per_pipeline < 1:
        raise rec.InputError("--partitions and --rounds-per-pipeline must be at least 1")
    started = time.perf_counter()
    files = rec.list_input_files(input_path)
    if options.capacities:
        read_capacities(options.capacities, options.max_contributions)  # fail fast on a bad file
    work = storage.join(output, WORK_DIR)
    storage.clear_directory(work)
    prepare_output(output)
    beam_options = pipeline_options(beam_args)
    if options.order == "alternate":
        options = _count_groups(files, options, partitions, beam_options, work)
    rounds: list[dict] = []
    passes, pass_rounds, run_index, new_pass, converged, rejects = 1, 0, 0, False, False, None
    counters: list[dict] = []
    invocation = uuid.uuid4().hex[:12]
    while True:
        block = (
            rounds_per_pipeline
            if options.max_rounds is None
            else min(rounds_per_pipeline, options.max_rounds - len(rounds))
        )
        log.info("pipeline run %d: pass %d, rounds %d-%d", run_index + 1, passes, len(rounds) + 1, len(rounds) + block)
        pipeline = beam.Pipeline(options=beam_options)
        # Unique per invocation: workers cache static arrays by path.
        run_name = f"{invocation}-run-{run_index:04d}"
        _ = pipeline | "Bound" >> BoundPipeline(
            files, output, options, partitions, block, run_name, run_index > 0, new_pass
        )
        try:
            result = pipeline.run()
            result.wait_until_finish()
        except Exception as error:  # the runner wraps what workers raise; bad input must still read clearly
            _raise_input_error_in(error)
            raise

        counters.append(_counters(result))
        summary = json.loads(storage.read_text(storage.join(work, "summary.json")))
        if rejects is None:
            rejects_file = storage.join(work, "rejected.jsonl")
            rejects = rec.Rejects.from_jsonl(
                storage.read_text(rejects_file) if storage.kind(rejects_file) == "file" else ""
            )
            if len(rejects) and options.on_invalid == "error":
                prepare_output(output)  # this run's partial selection must not outlive its error
                storage.clear_directory(work)
            handle_rejects(rejects, options.on_invalid, output)
        eligible = summary.get(_round_stat(0, "eligible"), 0)
        if eligible == 0 and pass_rounds == 0:
            converged, passes = True, passes - 1
            break
        for round_index in range(1, block + 1):
            if eligible == 0:
                break
            eligible = summary[_round_stat(round_index, "eligible")]
            rounds.append(
                {
                    "round": len(rounds) + 1,
                    "pass": passes,
                    "selected": summary[_round_stat(round_index, "selected")],
                    "eligible": eligible,
                }
            )
            pass_rounds += 1
            log.info(
                "round %d (pass %d): selected %d, %d records still eligible, %.1f s",
                len(rounds),
                passes,
                rounds[-1]["selected"],
                eligible,
                time.perf_counter() - started,
            )
        run_index, new_pass = run_index + 1, False
        if eligible > 0:
            if options.max_rounds is not None and len(rounds) >= options.max_rounds:
                break
            continue
        if not options.duplicates:
            converged = True
            break
        passes, pass_rounds, new_pass = passes + 1, 0, True
    for shard in range(options.output_shards):
        if storage.kind(shard_path(output, shard, options.output_shards)) == "missing":
            write_selection_shard(
                shard_path(output, shard, options.output_shards),
                sorted_selection(pa.array([], pa.int64()), np.zeros(0, np.int64)),
            )
    report = base_report(
        options,
        beam_options.view_as(StandardOptions).runner,
        input_path,
        summary.get("input_rows", 0),
        summary.get("input_records", 0),
        summary.get("input_users", 0),
        rejects,
        summary.get("repeated_users_removed", 0),
    )
    report.update(
        selected_records=summary.get("selected_records", 0),
        distinct_selected=summary.get("distinct_selected", 0),
        max_user_contribution=summary.get("max_user_contribution", 0),
        rounds=len(rounds),
        passes=passes,
        converged=converged,
        per_round=rounds,
        partitions=partitions,
        histograms=histograms(summary),
        beam_counters_per_run=counters,
        selection_files=selection_manifest(output, options.output_shards),
        wall_time_s=round(time.perf_counter() - started, 3),
    )
    storage.clear_directory(work)
    write_report(output, report)
    return report
