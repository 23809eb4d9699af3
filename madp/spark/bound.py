"""`madp bound --runner pyspark`: contribution bounding natively on Apache Spark (PySpark RDDs).

Spark moves the partitions and every step is a function of `madp.core.bound_steps`, as on Beam:

  build:  record partitions (by id hash) -> `build_record_partition` -> incidences by user partition
          -> `build_user_partition`: the state, an RDD of (user partition, packed UserPartition)
  a step: proposals to record partitions (`select_unanimous`), acceptances back (`consume_in_partition`),
          deaths to co-owners (`retire_in_partition`)
  end:    once little is left, `finish_locally` in one task; then `finish_record_partition` per record
          partition and the selection shards written

The driver drives the rounds: each step's counts come back as one small value (IterationCounts and the
summed stats) and `Progress.advanced` decides the next. Each step's state is persisted (`KEPT`: on disk)
and the one before released once the new one is materialized; every `checkpoint_every` steps a reliable
checkpoint bounds the lineage. A user or record partition p lives in Spark partition p throughout, so a
step's joins move its messages, not its state. The driver holds only control values and counts.

A selection shard is written by its task under a folder of the task's own attempt, and the driver moves
the winners into OUTPUT once the job has finished: a retried or speculative task leaves no partial or
duplicate file. The bounding has no secret (its order's ties are broken by `--seed`, default 0).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from madp.core import record_reading, storage
from madp.core import records as rec
from madp.core.bound_steps import (
    IterationCounts,
    Progress,
    SelectedKeys,
    UserPartition,
    build_record_partition,
    build_user_partition,
    capacities_by_partition,
    consume_in_partition,
    contribution_stats,
    finish_locally,
    finish_record_partition,
    propose_to_record_partitions,
    retire_in_partition,
    select_unanimous,
)
from madp.core.bounding import DONE, START_PASS, Capacities, Control
from madp.core.errors import InputError
from madp.core.partitioning import BOUND_RECORDS_PER_PARTITION
from madp.core.reports import BoundReport
from madp.core.routing import by_kind, messages_of
from madp.core.selection import (
    WORK_DIR,
    BoundOptions,
    RunCounts,
    group_sizes,
    handle_rejects,
    partitioned_bound_report,
    prepare_output,
    read_capacities,
    selection_manifest,
    selection_shard,
    shard_path,
    stat_total,
    write_missing_shards,
    write_report,
)
from madp.spark.dataframe import as_dataframe, input_name, read_input, user_id_type
from madp.spark.faults import fault_watch
from madp.spark.records import KEPT, by_part, gathered, kept, raising_kept_errors, record_partitions, summed_stats
from madp.spark.session import RUNNER, SparkOptions, spark_session

if TYPE_CHECKING:
    from pyspark import RDD, SparkContext
    from pyspark.sql import DataFrame

log = logging.getLogger("madp.bound")
STATE, ACCEPTED, DEAD, INCIDENCES, CAPACITIES, RECORDS, SELECTED, COUNTED = (
    "state",
    "accepted",
    "dead",
    "incidences",
    "capacities",
    "records",
    "selected",
    "counted",
)
Totals = tuple[IterationCounts, dict[str, int]]  # what a step's partitions counted, summed
NO_TOTALS: Totals = (IterationCounts(), {})


def _added(first: Totals, second: Totals) -> Totals:
    counts = IterationCounts(*(a + b for a, b in zip(first[0], second[0])))
    stats = dict(first[1])
    for name, value in second[1].items():
        stats[name] = stat_total(name, [stats[name], value]) if name in stats else value
    return counts, stats


class _BuiltUsers(NamedTuple):
    """A user partition as built: its packed state (None where the certificate left it no incidence)
    and what it counted."""

    packed: bytes | None
    totals: Totals


class _Consumed(NamedTuple):
    """A user partition after its consume step: the state, the records it retired here, and their keys
    for the co-owning user partitions."""

    packed: bytes
    dead: np.ndarray
    dead_elsewhere: list[tuple[int, np.ndarray]]


class _Retired(NamedTuple):
    """A user partition after a step: its packed state (None where no user is left) and its counts."""

    packed: bytes | None
    totals: Totals


def _build_users(element: tuple[int, Iterable[tuple[str, Any]]], default: int) -> list[tuple[int, _BuiltUsers]]:
    part, values = element
    grouped = by_kind(values)
    if INCIDENCES not in grouped:  # capacities listed for users of no record
        return []
    capacities = grouped[CAPACITIES][0] if CAPACITIES in grouped else Capacities(default)
    built = build_user_partition(part, grouped[INCIDENCES], capacities)
    packed = None if built.state is None else built.state.packed()
    counts = IterationCounts()
    if built.state is not None:
        counts = IterationCounts(eligible=int(built.state.owned().sum()), active=built.state.incidences)
    stats = {**built.input_stats, **built.counted(0 if packed is None else len(packed))}
    return [(part, _BuiltUsers(packed, (counts, stats)))]


def _consume(values: Iterable[tuple[str, Any]], pass_start: bool, certify: bool) -> list[_Consumed]:
    grouped = by_kind(values)
    if STATE not in grouped:  # messages go to partitions that exist; a partition that left hears none
        return []
    state = UserPartition.unpacked(grouped[STATE][0])
    consumed = consume_in_partition(state, messages_of(grouped, ACCEPTED), pass_start, certify)
    return [_Consumed(state.packed(), consumed.dead, consumed.dead_elsewhere)]


def _retire(values: Iterable[tuple[str, Any]], duplicates: bool) -> list[_Retired]:
    grouped = by_kind(values)
    if STATE not in grouped:
        return []
    ((packed, dead),) = grouped[STATE]
    retired = retire_in_partition(UserPartition.unpacked(packed), dead, messages_of(grouped, DEAD), duplicates)
    counts = IterationCounts(eligible=retired.eligible, active=retired.state.incidences)
    stays = retired.state.packed() if retired.stays else None
    return [_Retired(stays, (counts, contribution_stats(retired.departed_contributions)))]


def _finish_locally(packed: Iterable[bytes], control: Control) -> list:
    return [finish_locally([UserPartition.unpacked(each) for each in packed], control)]


def _attempt_writer(output: str, attempts: str, shards: int) -> Callable[[tuple[int, Iterable]], tuple[str, str]]:
    """A task that writes one output shard from its parts under a folder of its own attempt, and gives
    (that folder, the shard's path below it and below OUTPUT) for the driver to move once the job is done."""

    def write(element: tuple[int, Iterable]) -> tuple[str, str]:
        from pyspark import TaskContext

        shard, tables = element
        task = TaskContext.get()
        attempt = "attempt-local" if task is None else f"attempt-{task.stageId()}-{task.partitionId()}-"
        if task is not None:
            attempt += f"{task.attemptNumber()}-{task.taskAttemptId()}"
        folder = storage.join(attempts, attempt)
        relative = storage.below(output, shard_path(output, shard, shards))
        table = selection_shard(list(tables))
        with storage.open_output(storage.join(folder, relative)) as handle:
            storage.parquet_to(handle, table)
        return folder, relative

    return write


@dataclasses.dataclass
class _SparkBound:
    """One bounding on Spark, driven from here: the RDDs of its state and the counts it gathered."""

    sc: SparkContext
    options: BoundOptions
    spark_options: SparkOptions
    capacities: Capacities | None
    run_dir: str
    stats: dict[str, int] = dataclasses.field(default_factory=dict)
    selected: list[RDD] = dataclasses.field(default_factory=list)  # (record partition, SelectedKeys) of each step
    active: dict[int, int] = dataclasses.field(default_factory=dict)  # undecided incidences after each iteration
    steps: int = 0
    partitions: int = 0  # once the input is read: --partitions, or as many as its size asks for

    @property
    def errors_dir(self) -> str:
        return storage.join(self.run_dir, "input-errors")

    def _count(self, totals: Totals) -> IterationCounts:
        self.stats = summed_stats([self.stats, totals[1]])
        return totals[0]

    def read(self, source: list[str] | DataFrame) -> tuple[RDD, rec.Rejects, RDD]:
        """The record partitions, (record partition, [RecordChunk, ...]), of the input files or DataFrame
        `source`, the read's rejects, and the persisted reads (`SparkRecords.reads`)."""
        read = read_input(self.sc, source, self.options.columns, self.spark_options.input_split_bytes, self.errors_dir)
        self.stats = summed_stats([self.stats, read.stats])
        rows = RunCounts.of(read.stats).input_rows
        cores = self.sc.defaultParallelism
        self.partitions = self.spark_options.partitions_for(rows, cores, BOUND_RECORDS_PER_PARTITION)
        return record_partitions(read.chunks, self.partitions), read.rejects, read.reads

    def group_sizes(self, parts: RDD) -> tuple[int, int]:
        """--order alternate: records with at most u users and with more, as the bounding sees them."""
        threshold = self.options.alternate[0]

        def sizes(chunks: list[rec.RecordChunk]) -> tuple[int, int]:
            return group_sizes(rec.merged_records(chunks, rec.Rejects()).arity, threshold)

        counted = parts.values().map(kept(self.errors_dir, sizes)).collect()
        return sum(small for small, _ in counted), sum(large for _, large in counted)

    def build(self, parts: RDD) -> tuple[RDD, RDD, rec.Rejects, IterationCounts]:
        """Both sides: the record partitions (record partition, RecordPartition), the state (user
        partition, packed UserPartition), the duplicated ids rejected, and the state's counts."""

        options, partitions = self.options, self.partitions
        capacities = self.capacities or Capacities(options.max_contributions)

        def build_records(element: tuple[int, list]) -> list[tuple[int, tuple[str, Any]]]:
            part, chunks = element
            built = build_record_partition(part, chunks, options, partitions, capacities)
            counted = (built.rejects if len(built.rejects) else None, {**built.counted, **built.distribution})
            return [
                (part, (COUNTED, counted)),
                (part, (RECORDS, built.split.records)),
                *((part, (INCIDENCES, batch)) for batch in built.split.incidences),
            ]

        # (record partition, (kind, value)): a partition's parts as elements of their own, so that a task
        # pickles or reads back one of them at a time, never the whole partition built
        built = parts.flatMap(kept(self.errors_dir, build_records), True).persist(KEPT)

        def of_kind(kind: str) -> RDD:
            return built.filter(lambda e: e[1][0] == kind).mapValues(lambda v: v[1])

        read_sides = of_kind(COUNTED).values().collect()
        duplicates = rec.merge_rejects(rejects for rejects, _ in read_sides if rejects is not None)
        self.stats = summed_stats([self.stats, *(stats for _, stats in read_sides)])
        records = of_kind(RECORDS).persist(KEPT)
        incidences = of_kind(INCIDENCES).map(lambda e: (e[1][0], (INCIDENCES, e[1][1])))
        listed = [] if self.capacities is None else list(capacities_by_partition(self.capacities, partitions))
        tagged = incidences.union(self.sc.parallelize([(p, (CAPACITIES, c)) for p, c in listed], 1))
        build_users = kept(self.errors_dir, lambda e: _build_users(e, options.max_contributions))
        users = tagged.groupByKey(partitions, by_part).flatMap(build_users, True).persist(KEPT)
        counts = self._count(users.values().map(lambda b: b.totals).fold(NO_TOTALS, _added))
        records.count()  # materialized from the build's cache, which goes
        built.unpersist()
        state = users.filter(lambda e: e[1].packed is not None).mapValues(lambda b: b.packed)
        return records, state, duplicates, counts

    def step(self, state: RDD, progress: Progress, first: bool = False) -> tuple[RDD, RDD, IterationCounts]:
        """One step on the state from `progress`: a round (proposals, unanimous selection, saturation) or
        a pass start (saturation only); `first`, the first saturation (no proposals; without duplicates
        the saturation certificate's rejections too). The state after it, the persisted RDD it comes
        from (the driver releases it once the next is built), and what the step counted."""

        self.steps += 0 if first else 1
        partitions, duplicates = self.partitions, self.options.duplicates
        pass_start, certify, selects = progress.control.next == START_PASS, first and not duplicates, not first
        messages: list[RDD] = []  # the acceptances, where the step selects
        selected_counts = self.sc.emptyRDD()
        if selects and progress.selects:
            passes = progress.control.passes
            proposals = state.flatMap(lambda e: propose_to_record_partitions(UserPartition.unpacked(e[1])).batches)
            selections = (
                proposals.groupByKey(partitions, by_part)
                .mapValues(lambda batches: select_unanimous(list(batches)))
                .persist(KEPT)
            )
            selected = (
                selections.mapValues(lambda s: SelectedKeys(s.selected, passes))
                .filter(lambda e: len(e[1].keys) > 0)
                .persist(KEPT)
            )
            self.selected.append(selected)
            selected_counts = selected.values().map(lambda s: (IterationCounts(selected=len(s.keys)), {}))
            messages.append(selections.flatMap(lambda e: [(user, (ACCEPTED, keys)) for user, keys in e[1].accepted]))
        joined = gathered(partitions, state.mapValues(lambda packed: (STATE, packed)), *messages)
        consumed = joined.flatMapValues(lambda values: _consume(values, pass_start, certify)).persist(KEPT)
        dead = consumed.flatMap(lambda e: [(user, (DEAD, keys)) for user, keys in e[1].dead_elsewhere])
        retired = (
            gathered(partitions, consumed.mapValues(lambda c: (STATE, (c.packed, c.dead))), dead)
            .flatMapValues(lambda values: _retire(values, duplicates))
            .persist(KEPT)
        )
        if self.steps and self.steps % self.spark_options.checkpoint_every == 0:
            retired.checkpoint()  # reliable: the lineage restarts here, a lost executor's blocks are read back
        totals = selected_counts.union(retired.values().map(lambda r: r.totals)).fold(NO_TOTALS, _added)
        consumed.unpersist()
        if selects and progress.selects:
            selections.unpersist()
        counts = self._count(totals)
        self.active[self.steps] = counts.active
        return retired.filter(lambda e: e[1].packed is not None).mapValues(lambda r: r.packed), retired, counts

    def finish(self, state: RDD, progress: Progress) -> Control:
        """The end of the rounds: where the algorithm is done, the users left give their contributions;
        where little is left, one task finishes it (`finish_locally`)."""

        if progress.control.next == DONE:
            contributions = state.values().map(
                lambda p: contribution_stats(UserPartition.unpacked(p).side.contribution)
            )
            self.stats = summed_stats([self.stats, contributions.fold({}, lambda a, b: summed_stats([a, b]))])
            return progress.control
        control = progress.control
        finished = state.values().coalesce(1).mapPartitions(lambda packed: _finish_locally(packed, control))
        finished = finished.persist(KEPT)
        ((final, incidences, stats),) = finished.map(
            lambda f: (f.control, f.incidences, contribution_stats(f.contribution))
        ).collect()
        self.stats = summed_stats([self.stats, stats, {"finished_locally_incidences": incidences}])
        self.selected.append(finished.flatMap(lambda f: f.selected))
        return final

    def write_selection(self, records: RDD, control: Control, passes_at_start: int, output: str) -> int:
        """The record partitions' selections and counts; their shards written to OUTPUT; the shards."""

        shards = self.options.shards(RunCounts.of(self.stats).input_records)
        tagged = [records.mapValues(lambda r: (RECORDS, r))]
        tagged.extend(selected.mapValues(lambda s: (SELECTED, s)) for selected in self.selected)

        def finish(values: Iterable[tuple[str, Any]]):
            grouped = by_kind(values)
            (part_records,) = grouped[RECORDS]
            return finish_record_partition(part_records, grouped.get(SELECTED, []), control, passes_at_start, shards)

        finished = gathered(self.partitions, *tagged).mapValues(finish).persist(KEPT)
        stats = finished.values().map(lambda f: {**f.counted, **f.distribution}).collect()
        self.stats = summed_stats([self.stats, *stats])
        attempts = storage.join(self.run_dir, "attempts")
        written = (
            finished.values()
            .flatMap(lambda f: f.shards.items())
            .groupByKey(shards, by_part)
            .map(_attempt_writer(output, attempts, shards))
            .collect()
        )
        for folder, relative in written:  # the winning attempts, once every shard is written
            storage.move_below(folder, output, [relative])
        finished.unpersist()
        return shards


def _bound_on_spark(
    sc: SparkContext,
    source: list[str] | DataFrame,
    output: str,
    options: BoundOptions,
    spark_options: SparkOptions,
    capacities: Capacities | None,
    run_dir: str,
    checkpoints: str,
) -> tuple[_SparkBound, BoundOptions, Control, rec.Rejects, int]:
    """The bounding's Spark jobs on the input files or DataFrame `source`, its work files under `run_dir`
    and its checkpoints under `checkpoints`: (the job's counts, the options as run, the final control,
    every rejected row, the output shards)."""
    job = _SparkBound(sc, options, spark_options, capacities, run_dir)
    sc.setCheckpointDir(checkpoints)
    threshold = spark_options.local_finish_incidences
    with raising_kept_errors(job.errors_dir):
        parts, rejects, reads = job.read(source)
        if options.order == "alternate":
            small, large = job.group_sizes(parts)
            options = job.options = dataclasses.replace(options, group_sizes=(small, large))
            log.info(
                "--order alternate: %d records with at most %d users, %d with more", small, options.alternate[0], large
            )
        records, state, duplicates, counts = job.build(parts)
        reads.unpersist()  # the record partitions are built from them
        rejects = rec.merge_rejects([rejects, duplicates])
        if options.on_invalid == "error":  # before any round
            handle_rejects(rejects, options.on_invalid, output)
        start = Control(options.duplicates, options.max_rounds)
        progress, released = Progress(start), None
        if (capacities is not None or not options.duplicates) and start.next != DONE:  # the first saturation
            state, released, counts = job.step(state, progress, first=True)
        progress = progress.advanced(
            counts.selected, counts.eligible, counts.active, threshold, start.next == START_PASS
        )
        while progress.control.next != DONE and not progress.finish_locally:
            state, last, counts = job.step(state, progress)
            if released is not None:
                released.unpersist()  # the step before: the new state is materialized
            released = last
            progress = progress.advanced(counts.selected, counts.eligible, counts.active, threshold, True)
        control = job.finish(state, progress)
        control.log_rounds()
        shards = job.write_selection(records, control, start.passes, output)
    return job, options, control, rejects, shards


def run_spark(input: str | DataFrame, output: str, options: BoundOptions, spark_options: SparkOptions) -> BoundReport:
    """`madp bound --runner pyspark`: the bounding's Spark jobs on the input path or DataFrame `input`
    (`madp.spark.dataframe`), in the DataFrame's session, the caller's active SparkSession or one built
    from `spark_options`; the same selection files, byte for byte, as `--runner local`."""
    started = time.perf_counter()
    frame = as_dataframe(input)
    files = rec.list_input_files(str(input)) if frame is None else []
    capacities = read_capacities(options.capacities, options.max_contributions) if options.capacities else None
    # Before the earlier selection goes: the input's user ids' type (its first file's) against the capacities.
    if frame is None:
        users = record_reading.leading_facts(files[0], options.columns).user_type
    else:
        users = user_id_type(frame, options.columns)
    source = files if frame is None else frame
    if capacities is not None and users is not None:
        capacities.typed_as(users)
    work = storage.join(output, WORK_DIR)
    storage.remove_tree(work)
    prepare_output(output)
    invocation = uuid.uuid4().hex[:12]  # a run's files never meet an earlier one's
    run_dir = storage.join(work, invocation)
    checkpoints = storage.join(spark_options.checkpoint_dir or run_dir, f"checkpoints-{invocation}")
    try:
        with spark_session(spark_options, frame) as spark, fault_watch(spark.sparkContext, "madp bound") as watch:
            job, options, control, rejects, shards = _bound_on_spark(
                spark.sparkContext, source, output, options, spark_options, capacities, run_dir, checkpoints
            )
            faults = watch.faults()
    except InputError:
        prepare_output(output)  # no partial selection outlives an error
        storage.remove_tree(work)
        raise
    finally:
        storage.remove_tree(checkpoints)
    handle_rejects(rejects, options.on_invalid, output)
    write_missing_shards(output, shards)
    counts = RunCounts.of(job.stats)
    iterations = [
        {"iteration": index, "active_incidences": left}
        for index, left in sorted(({0: counts.built_incidences} | job.active).items())
    ]
    manifest = selection_manifest(output, shards)
    runs = [counts.run_figures(iterations)]
    report = partitioned_bound_report(
        options, RUNNER, input_name(input), job.stats, rejects, control, manifest, job.partitions, runs
    )
    report = dataclasses.replace(report, spark_faults=faults)
    storage.remove_tree(work)
    write_report(output, report)
    return dataclasses.replace(report, wall_time_s=round(time.perf_counter() - started, 3))
