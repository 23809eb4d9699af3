"""Contribution bounding as an Apache Beam pipeline: the `madp.bounding` kernels on partitions.

Records are split into `partitions` record partitions (by id hash) and user partitions (by
user hash); every element is a whole columnar partition, never a single record. Each round of
Alg. 1 is unrolled in the graph as four shuffles:

  users --proposals--> records --accepted--> users --dead--> records --dead--> users

A pipeline run unrolls a block of rounds; the driver (`run_beam`) chains runs until the
algorithm converges, carrying the partial selection in OUTPUT/_work/, and starts a new pass
over residual capacities for the with-duplicates variant.
"""
from __future__ import annotations

import dataclasses
import io
import json
import logging
import time
from typing import Any, Tuple

import apache_beam as beam
import numpy as np
import pyarrow as pa
from apache_beam.metrics import Metrics
from apache_beam.options.pipeline_options import DirectOptions, PipelineOptions, StandardOptions

from madp import records as rec
from madp import storage
from madp.bounding import Capacities, UserSide, build_user_side, consume, local_mask, preference_keys, propose, \
    retire, unanimous
from madp.hashing import partition_of
from madp.selection import (BoundOptions, base_report, handle_rejects, read_capacities, selection_shards,
                            shard_path, sorted_selection, write_report, write_selection_shard, prepare_output)

log = logging.getLogger("madp.bound")
NAMESPACE = "madp.bound"
WORK_DIR = "_work"
DEFAULT_PARTITIONS = 4
DEFAULT_ROUNDS_PER_PIPELINE = 8


@dataclasses.dataclass(frozen=True)
class RecordState:
    """A record partition's side of the algorithm (keys sorted)."""
    keys: np.ndarray
    arity: np.ndarray
    eligible: np.ndarray
    copies: np.ndarray
    in_pass: np.ndarray
    user_partition_offsets: np.ndarray  # CSR: distinct user partitions of each record
    user_partitions: np.ndarray


@dataclasses.dataclass(frozen=True)
class UserPartition:
    side: UserSide
    record_partition: np.ndarray  # record partition of each of side.record_keys

    def evolve(self) -> "UserPartition":
        """A copy whose mutable state can change without touching the input element."""
        side = dataclasses.replace(self.side, eligible=self.side.eligible.copy(), residual=self.side.residual.copy())
        return UserPartition(side, self.record_partition)


def _split(keys: np.ndarray, partition: np.ndarray):
    """(partition, keys) for each partition present."""
    order = np.argsort(partition, kind="stable")
    parts, starts = np.unique(partition[order], return_index=True)
    for part, chunk in zip(parts, np.split(keys[order], starts[1:])):
        yield int(part), chunk


def _stat(name: str, value: int) -> beam.pvalue.TaggedOutput:
    return beam.pvalue.TaggedOutput("stats", (name, int(value)))


def _round_stat(round_index: int, what: str) -> str:
    return f"round_{round_index:05d}_{what}"


# --- reading ---------------------------------------------------------------------------------

@beam.typehints.with_output_types(Tuple[int, Any])
class _ReadFile(beam.DoFn):
    def __init__(self, columns: rec.Columns, partitions: int):
        self.columns, self.partitions = columns, partitions

    def process(self, element):
        index, path = element
        result = rec.read_file(path, index, self.columns)
        Metrics.counter(NAMESPACE, "input_rows").inc(result.rows_read)
        yield _stat("input_rows", result.rows_read)
        yield _stat("repeated_users_removed", result.repeated_users_removed)
        if len(result.rejects):
            yield beam.pvalue.TaggedOutput("rejects", result.rejects)
        partition = partition_of(result.chunk.ids, self.partitions) if len(result.chunk) else np.zeros(0, np.int64)
        for part in np.unique(partition):
            yield int(part), rec.take(result.chunk, partition == part)


@beam.typehints.with_output_types(Tuple[int, Any])
class _BuildRecordPartition(beam.DoFn):
    """Merge a record partition's chunks, reject duplicated ids, attach the partial selection."""

    def __init__(self, options: BoundOptions, partitions: int, state_dir: str | None, new_pass: bool):
        self.options, self.partitions, self.state_dir, self.new_pass = options, partitions, state_dir, new_pass

    def process(self, element):
        part, chunks = element
        chunks = sorted(chunks, key=lambda c: int(c.keys[0]))
        rejects = rec.Rejects()
        chunk = rec.reject_duplicates(rec.merge_chunks(chunks), rejects)
        if len(rejects):
            yield beam.pvalue.TaggedOutput("rejects", rejects)
        yield _stat("input_records", len(chunk))
        n = len(chunk)
        copies, in_pass = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=bool)
        if self.state_dir:
            with storage.open_input(storage.join(self.state_dir, f"state-{part:05d}.npz")) as handle:
                saved = np.load(io.BytesIO(handle.read()))
            if not np.array_equal(saved["keys"], chunk.keys):
                raise RuntimeError(f"partition {part}: input changed between pipeline runs")
            copies, in_pass = saved["copies"], saved["in_pass"] & (not self.new_pass)
        arity = chunk.arity
        keys = preference_keys(chunk.ids, arity, self.options.order, self.options.seed, chunk.weights)
        user_partition = partition_of(chunk.users, self.partitions) if len(chunk.users) else np.zeros(0, np.int64)
        record_of_incidence = np.repeat(np.arange(n), arity)
        pairs = np.unique(record_of_incidence * self.partitions + user_partition)
        offsets = np.concatenate([[0], np.cumsum(np.bincount(pairs // self.partitions, minlength=n))]).astype(np.int64)
        yield beam.pvalue.TaggedOutput("ids", (part, (chunk.keys, chunk.ids)))
        yield part, RecordState(keys=chunk.keys, arity=arity, eligible=~in_pass, copies=copies, in_pass=in_pass,
                                user_partition_offsets=offsets, user_partitions=pairs % self.partitions)
        for user_part in np.unique(user_partition):
            mine = user_partition == user_part
            records = record_of_incidence[mine]
            yield beam.pvalue.TaggedOutput("incidences", (int(user_part), {
                "users": chunk.users.filter(pa.array(mine)), "record_keys": chunk.keys[records],
                "order": tuple(k[records] for k in keys), "copies": copies[records], "in_pass": in_pass[records],
                "record_partition": np.full(len(records), part, dtype=np.int64)}))


def _split_capacities(path: str, default: int, partitions: int):
    capacities = read_capacities(path, default)
    partition = partition_of(capacities.user_ids, partitions)
    for part in range(partitions):
        mine = partition == part
        yield part, Capacities(default, capacities.user_ids.filter(pa.array(mine)), capacities.values[mine])


def _build_user_partition(element, default: int):
    part, grouped = element
    chunks = grouped["incidences"]
    capacities = grouped["capacities"][0] if grouped["capacities"] else Capacities(default)
    record_keys_all = np.concatenate([c["record_keys"] for c in chunks])
    record_keys, first, inc_record = np.unique(record_keys_all, return_index=True, return_inverse=True)
    pick = lambda name: np.concatenate([c[name] for c in chunks])[first]  # noqa: E731
    order = tuple(np.concatenate([c["order"][i] for c in chunks])[first] for i in range(3))
    side = build_user_side(pa.concat_arrays([c["users"] for c in chunks]), inc_record.astype(np.int64), record_keys,
                           order, capacities, pick("copies"), pick("in_pass"))
    return part, UserPartition(side, pick("record_partition"))


# --- the four steps of a round ------------------------------------------------------------------

@beam.typehints.with_output_types(Tuple[int, Any])
class _Propose(beam.DoFn):
    def process(self, element):
        part, state = element
        proposed = propose(state.side)
        index = state.side.inc_record[proposed]
        for record_part, keys in _split(state.side.record_keys[index], state.record_partition[index]):
            yield beam.pvalue.TaggedOutput("proposals", (record_part, keys))
        yield part, state


@beam.typehints.with_output_types(Tuple[int, Any])
class _Select(beam.DoFn):
    def __init__(self, round_index: int):
        self.round_index = round_index

    def process(self, element):
        part, grouped = element
        (state,) = grouped["state"]
        proposals = np.concatenate(grouped["proposals"]) if grouped["proposals"] else np.zeros(0, np.int64)
        accepted = unanimous(np.searchsorted(state.keys, proposals), state.arity) & state.eligible
        Metrics.counter(NAMESPACE, "selected_records").inc(int(accepted.sum()))
        yield _stat(_round_stat(self.round_index, "selected"), accepted.sum())
        yield part, dataclasses.replace(state, eligible=state.eligible & ~accepted, copies=state.copies + accepted,
                                        in_pass=state.in_pass | accepted)
        yield from _notify_users(state, accepted, "accepted")


def _notify_users(state: RecordState, records: np.ndarray, tag: str):
    index = np.flatnonzero(records)
    counts = np.diff(state.user_partition_offsets)[index]
    positions = np.repeat(state.user_partition_offsets[index], counts) + (
        np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts))
    for user_part, keys in _split(np.repeat(state.keys[index], counts), state.user_partitions[positions]):
        yield beam.pvalue.TaggedOutput(tag, (user_part, keys))


@beam.typehints.with_output_types(Tuple[int, Any])
class _Consume(beam.DoFn):
    def process(self, element):
        part, grouped = element
        (state,) = grouped["state"]
        state = state.evolve()
        keys = np.concatenate(grouped["accepted"]) if grouped["accepted"] else np.zeros(0, np.int64)
        dead = consume(state.side, local_mask(state.side.record_keys, keys))
        for record_part, dead_keys in _split(state.side.record_keys[dead], state.record_partition[dead]):
            yield beam.pvalue.TaggedOutput("dead", (record_part, dead_keys))
        yield part, state


@beam.typehints.with_output_types(Tuple[int, Any])
class _RecordDeaths(beam.DoFn):
    def __init__(self, round_index: int):
        self.round_index = round_index

    def process(self, element):
        part, grouped = element
        (state,) = grouped["state"]
        keys = np.concatenate(grouped["dead"]) if grouped["dead"] else np.zeros(0, np.int64)
        newly_dead = local_mask(state.keys, keys) & state.eligible
        state = dataclasses.replace(state, eligible=state.eligible & ~newly_dead)
        yield _stat(_round_stat(self.round_index, "eligible"), state.eligible.sum())
        yield part, state
        yield from _notify_users(state, newly_dead, "dead")


@beam.typehints.with_output_types(Tuple[int, Any])
class _Retire(beam.DoFn):
    def process(self, element):
        part, grouped = element
        (state,) = grouped["state"]
        if grouped["dead"]:
            state = state.evolve()
            retire(state.side, local_mask(state.side.record_keys, np.concatenate(grouped["dead"])))
        yield part, state


class _Step(beam.PTransform):
    """Join a partitioned state with its messages and apply one step."""

    def __init__(self, step: beam.DoFn, message: str, outputs: tuple[str, ...]):
        super().__init__()
        self.step, self.message, self.outputs = step, message, outputs

    def expand(self, inputs):
        state, messages = inputs
        return ({"state": state, self.message: messages}
                | "Join" >> beam.CoGroupByKey()
                | "Apply" >> beam.ParDo(self.step).with_outputs(*self.outputs, main="state"))


class Saturate(beam.PTransform):
    """Alg. 1 lines 9-13: users take accepted records; records of saturated users leave E everywhere."""

    def __init__(self, round_index: int):
        super().__init__()
        self.round_index = round_index

    def expand(self, inputs):
        users, records, accepted = inputs
        consumed = (users, accepted) | "UsersTakeAccepted" >> _Step(_Consume(), "accepted", ("dead",))
        deaths = ((records, consumed.dead)
                  | "RecordsLearnDeaths" >> _Step(_RecordDeaths(self.round_index), "dead", ("dead", "stats")))
        users = (consumed.state, deaths.dead) | "UsersRetireDead" >> _Step(_Retire(), "dead", ())
        return users.state, deaths.state, deaths.stats


class ProposalRound(beam.PTransform):
    """One round of Alg. 1: proposals, unanimous selection, saturation."""

    def __init__(self, round_index: int):
        super().__init__()
        self.round_index = round_index

    def expand(self, inputs):
        users, records = inputs
        proposed = users | "UsersPropose" >> beam.ParDo(_Propose()).with_outputs("proposals", main="state")
        selected = ((records, proposed.proposals)
                    | "RecordsSelectUnanimous" >> _Step(_Select(self.round_index), "proposals", ("accepted", "stats")))
        users, records, death_stats = (proposed.state, selected.state, selected.accepted) | "Saturate" >> Saturate(
            self.round_index)
        return users, records, (selected.stats, death_stats)


# --- outputs ------------------------------------------------------------------------------------

def _write_state(element, state_dir: str):
    part, state = element
    buffer = io.BytesIO()
    np.savez(buffer, keys=state.keys, copies=state.copies, in_pass=state.in_pass)
    with storage.open_output(storage.join(state_dir, f"state-{part:05d}.npz")) as handle:
        handle.write(buffer.getvalue())
    yield "selected_records", int(state.copies.sum())
    yield "distinct_selected", int((state.copies > 0).sum())


def _selection_by_shard(element, shards: int):
    _, grouped = element
    (state,), ((keys, ids),) = grouped["state"], grouped["ids"]
    selected = state.copies > 0
    for shard, table in selection_shards(ids.filter(pa.array(selected)), state.copies[selected], shards).items():
        if len(table):
            yield shard, table


def _write_shard(element, output: str, shards: int):
    shard, tables = element
    table = pa.concat_tables(tables)
    write_selection_shard(shard_path(output, shard, shards),
                          sorted_selection(table["id"].combine_chunks(), table["copies"].to_numpy()))
    yield shard


def _aggregate_stats(element):
    name, values = element
    return name, (max(values) if name.startswith("max_") else sum(values))


def _merge_rejects(batches) -> rec.Rejects:
    merged = rec.Rejects()
    for batch in batches:
        merged.extend(batch)
    return merged


def _write_summary(stats: list, path: str):
    storage.write_text(path, json.dumps(dict(stats), sort_keys=True))


class BoundPipeline(beam.PTransform):
    """Read records, build both sides, run `rounds` unrolled rounds, write selection and state."""

    def __init__(self, files: list[str], output: str, options: BoundOptions, partitions: int, rounds: int,
                 state_dir: str | None, new_pass: bool):
        super().__init__()
        self.files, self.output, self.options, self.partitions = files, output, options, partitions
        self.rounds, self.state_dir, self.new_pass = rounds, state_dir, new_pass

    def expand(self, pbegin):
        work = storage.join(self.output, WORK_DIR)
        read = (pbegin
                | "ListFiles" >> beam.Create(list(enumerate(self.files)))
                | "SpreadFiles" >> beam.Reshuffle()
                | "ReadAndValidate" >> beam.ParDo(_ReadFile(self.options.columns, self.partitions)).with_outputs(
                    "rejects", "stats", main="chunks"))
        built = (read.chunks
                 | "GroupRecordPartitions" >> beam.GroupByKey()
                 | "BuildRecordPartitions" >> beam.ParDo(_BuildRecordPartition(
                     self.options, self.partitions, self.state_dir, self.new_pass)).with_outputs(
                     "ids", "incidences", "rejects", "stats", main="records"))
        capacities = (pbegin | "CapacitiesFile" >> beam.Create([self.options.capacities] if self.options.capacities
                                                                else [])
                      | "SplitCapacities" >> beam.FlatMap(_split_capacities, self.options.max_contributions,
                                                          self.partitions))
        users = ({"incidences": built.incidences, "capacities": capacities}
                 | "GroupUserPartitions" >> beam.CoGroupByKey()
                 | "BuildUserPartitions" >> beam.Map(_build_user_partition, self.options.max_contributions))
        no_messages = pbegin | "NoAcceptedYet" >> beam.Create([])
        users, records, setup_stats = (users, built.records, no_messages) | "SaturateInitially" >> Saturate(0)
        stats = [read.stats, built.stats, setup_stats]
        for round_index in range(1, self.rounds + 1):
            users, records, round_stats = (users, records) | f"Round{round_index}" >> ProposalRound(round_index)
            stats.extend(round_stats)
        stats.append(users | "UserStats" >> beam.FlatMap(
            lambda e: [("input_users", len(e[1].side.user_ids)),
                       ("max_user_contribution", int(e[1].side.contribution.max(initial=0)))]))
        stats.append(records | "WriteState" >> beam.FlatMap(_write_state, storage.join(work, "state")))
        shards = self.options.output_shards
        _ = ({"state": records, "ids": built.ids}
             | "JoinIds" >> beam.CoGroupByKey()
             | "SelectionByShard" >> beam.FlatMap(_selection_by_shard, shards)
             | "GroupShards" >> beam.GroupByKey()
             | "WriteShards" >> beam.FlatMap(_write_shard, self.output, shards))
        _ = ((read.rejects, built.rejects) | "AllRejects" >> beam.Flatten()
             | "MergeRejects" >> beam.CombineGlobally(_merge_rejects)
             | "WriteRejects" >> beam.Map(lambda r: storage.write_text(storage.join(work, "rejected.jsonl"),
                                                                         r.to_jsonl())))
        return (stats | "AllStats" >> beam.Flatten()
                | "GroupStats" >> beam.GroupByKey()
                | "AggregateStats" >> beam.Map(_aggregate_stats)
                | "CollectStats" >> beam.combiners.ToList()
                | "WriteSummary" >> beam.Map(_write_summary, storage.join(work, "summary.json")))


def pipeline_options(beam_args: list[str]) -> PipelineOptions:
    """The user's Beam options; the DirectRunner defaults to 2 worker processes."""
    options = PipelineOptions(beam_args)
    explicit = options.get_all_options(drop_default=True)
    if options.view_as(StandardOptions).runner in (None, "DirectRunner"):
        options.view_as(StandardOptions).runner = "DirectRunner"
        direct = options.view_as(DirectOptions)
        if "direct_running_mode" not in explicit:
            direct.direct_running_mode = "multi_processing"
        if "direct_num_workers" not in explicit:
            direct.direct_num_workers = 2
    return options


def run_beam(input_path: str, output: str, options: BoundOptions, beam_args: list[str],
             partitions: int = DEFAULT_PARTITIONS, rounds_per_pipeline: int = DEFAULT_ROUNDS_PER_PIPELINE) -> dict:
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
    rounds: list[dict] = []
    passes, pass_rounds, state_dir, new_pass, converged, rejects = 1, 0, None, False, False, None
    while True:
        block = rounds_per_pipeline if options.max_rounds is None else min(rounds_per_pipeline,
                                                                            options.max_rounds - len(rounds))
        with beam.Pipeline(options=beam_options) as pipeline:
            _ = pipeline | "Bound" >> BoundPipeline(files, output, options, partitions, block, state_dir, new_pass)
        summary = json.loads(storage.read_text(storage.join(work, "summary.json")))
        if rejects is None:
            rejects_file = storage.join(work, "rejected.jsonl")
            rejects = rec.Rejects.from_jsonl(storage.read_text(rejects_file)
                                             if storage.kind(rejects_file) == "file" else "")
            if len(rejects) and options.on_invalid == "error":
                storage.clear_directory(output)
            handle_rejects(rejects, options, output)
        eligible = summary.get(_round_stat(0, "eligible"), 0)
        if eligible == 0 and pass_rounds == 0:
            converged, passes = True, passes - 1
            break
        for round_index in range(1, block + 1):
            if eligible == 0:
                break
            eligible = summary[_round_stat(round_index, "eligible")]
            rounds.append({"round": len(rounds) + 1, "pass": passes,
                           "selected": summary[_round_stat(round_index, "selected")], "eligible": eligible})
            pass_rounds += 1
            log.info("round %d (pass %d): selected %d, %d records still eligible, %.1f s", len(rounds), passes,
                     rounds[-1]["selected"], eligible, time.perf_counter() - started)
        state_dir, new_pass = storage.join(work, "state"), False
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
            write_selection_shard(shard_path(output, shard, options.output_shards),
                                  sorted_selection(pa.array([], pa.int64()), np.zeros(0, np.int64)))
    report = base_report(options, beam_options.view_as(StandardOptions).runner, input_path,
                         summary.get("input_rows", 0), summary.get("input_records", 0),
                         summary.get("input_users", 0), rejects, summary.get("repeated_users_removed", 0))
    report.update(selected_records=summary.get("selected_records", 0),
                  distinct_selected=summary.get("distinct_selected", 0),
                  max_user_contribution=summary.get("max_user_contribution", 0), rounds=len(rounds),
                  passes=passes, converged=converged, per_round=rounds, partitions=partitions,
                  wall_time_s=round(time.perf_counter() - started, 3))
    storage.clear_directory(work)
    write_report(output, report)
    return report
