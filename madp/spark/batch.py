"""`madp batch --runner pyspark`: b-min-sep Poisson sampling (Alg. 3) natively on Apache Spark, as RDD
operations that call the batching's steps (`madp.core.batch_steps`, `batching.join_record_partition`)
on whole columnar partitions, each keyed by the partition that receives it (partition i of every
shuffle holds key i):

  records, selection shards -> record partitions (join) -> user partitions (neighbour pairs)
      -> record partitions (|N(e)| histogram; p calibrated in the driver) -> record partitions (samples)
      -> user partitions (blocked (user, step)) -> record partitions (survivors)
      -> pieces of the batch files (runs of their steps, written in parallel) -> batch files (joined)

The driver reads back only control values: the join's (graph digest, rejects, content description),
the histogram, the realized sizes per step, each written file's name and counts, and the
participation statistics. The secret sampling key (`BatchOptions.key`, a run without --seed)
travels inside the closures of the join and sampling tasks only: no Spark conf, broadcast or log line
holds it.

A task that writes a batch file (or a piece of one) writes it under a name of its own attempt and
returns that name; the driver moves the winners into place once every job has passed
(`batch_job.commit`), so a retried or speculative task leaves neither a partial nor a duplicate file,
and a failed run leaves the earlier batches as they were.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
from pyspark import RDD, SparkContext, TaskContext

from madp.core import batch_files, storage
from madp.core import records as rec
from madp.core.batch_files import Feature, FileCounts
from madp.core.batch_steps import (
    JoinedPartition,
    SampledPartition,
    Survivors,
    WrittenRouting,
    block_users,
    gathered_file_rows,
    merged_content,
    neighbour_pairs_by_record,
    neighbourhood_histogram,
    rows_of_steps,
    sample_partition,
    split_selection,
    survivors,
    units_of,
    written_by_partition,
    written_record_count,
)
from madp.core.errors import InputError
from madp.core.graph_digest import EMPTY as EMPTY_GRAPH
from madp.core.graph_digest import GraphDigest
from madp.core.options import declared
from madp.core.partitioning import BATCH_RECORDS_PER_PARTITION
from madp.core.reports import BatchReport
from madp.core.selection import RunCounts, handle_rejects
from madp.engines import batch_local, batch_report, batching
from madp.engines.batch_job import BatchSummary, JobInputs, JobRun, commit, job_inputs, removed_on_failure
from madp.engines.batch_report import merge_counts
from madp.spark.dataframe import as_dataframe, input_name, read_input
from madp.spark.faults import fault_watch
from madp.spark.records import KEPT, by_part, gathered, kept, raising_kept_errors, record_partitions
from madp.spark.session import RUNNER, SparkOptions, spark_session

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

log = logging.getLogger("madp.batch")
# SparkOptions of the bounding's rounds alone
BOUNDING_ONLY = ("checkpoint_dir", "checkpoint_every", "local_finish_incidences")
INPUT_ERRORS = "input-errors"  # under the run's folder in OUTPUT/_work: InputErrors the tasks met
COPY_BYTES = 1 << 24  # a batch file's pieces are joined in reads of this size
# A task writes a piece of at most about this many of the batches' expected rows, however few partitions
# the input has: the batches' T x B rows do not grow with the input (1M records in 4 partitions, T = B =
# 1000: pieces of 250,000 rows took a Python worker to 744 MB)
ROWS_PER_PIECE = 100_000


def grouped(rdd: RDD, partitions: int) -> RDD:
    """(partition, its values) of (partition, value) pairs, partition p in Spark partition p. Each map
    task's values are combined by partition before they cross, which `gathered` (for RDDs partitioned so
    already) does not: in its place the 10M-record batching took 11% more CPU time."""
    return rdd.groupByKey(partitions, by_part)


def cogrouped(partitions: int, *keyed: RDD) -> RDD:
    """(partition, (a list of the values of each of `keyed`)), partition p in Spark partition p; an RDD
    partitioned so already (`grouped`, `records.record_partitions`) is not shuffled again."""

    def tagged(index: int, rdd: RDD) -> RDD:
        return rdd.mapValues(lambda value: (index, value))

    sources = len(keyed)  # the closure below must hold no RDD

    def by_source(values: Iterable[tuple[int, Any]]) -> tuple[list, ...]:
        lists: tuple[list, ...] = tuple([] for _ in range(sources))
        for index, value in values:
            lists[index].append(value)
        return lists

    return gathered(partitions, *(tagged(index, rdd) for index, rdd in enumerate(keyed))).mapValues(by_source)


# --- the join and the histogram ------------------------------------------------------------------


class JoinFacts(NamedTuple):
    """What the driver reads of a record partition's join: control values and the rows it rejected."""

    digest: GraphDigest | None  # of its valid records (None: it has none)
    rejects: rec.Rejects  # duplicated ids; invalid content under --on-invalid skip
    described: tuple[int, dict[str, Feature]] | None  # (records written, content description), where joined
    records: int  # selected records joined
    id_type: str | None  # the ids' Arrow type, where joined


def join_facts(found: batching.RecordPartitionJoin) -> JoinFacts:
    joined = found.joined
    if joined is None:
        return JoinFacts(found.digest, found.rejects, None, 0, None)
    rejects = rec.merge_rejects([found.rejects, joined.rejects])
    described = (joined.written_records, joined.content)
    return JoinFacts(found.digest, rejects, described, joined.records, str(joined.id_type))


def joined_partitions(
    sc: SparkContext,
    records: RDD,
    selection: list[str],
    options: batching.BatchOptions,
    data: str,
    errors_dir: str,
) -> RDD:
    """(record partition, RecordPartitionJoin) of every record partition that has records or selected
    ids: its records (`records.record_partitions`) and the ids each selection shard (a task each) sends
    it, joined (`batching.join_record_partition`)."""
    partitions = records.getNumPartitions()

    def split(path: str) -> list:
        return split_selection(path, storage.read_parquet(path), partitions)

    def join(sources: tuple[list, list]) -> batching.RecordPartitionJoin:
        chunks, selected = sources  # chunks: the partition's list of RecordChunks, where it has records
        return batching.join_record_partition(chunks[0] if chunks else [], selected, options, data, partitions)

    ids = sc.parallelize(selection, max(1, len(selection))).flatMap(kept(errors_dir, split))
    return cogrouped(partitions, records, ids).mapValues(kept(errors_dir, join))


def neighbourhood_sizes(joined: RDD, partitions: int) -> dict[int, int]:
    """{|N(e)|: units} over all units (Alg. 3 line 1): the incidences go to their user partitions, the
    pairs their users make to the records' partitions, where each counts its units."""
    incidences = joined.flatMap(lambda item: [] if item[1].joined is None else item[1].joined.incidences)
    pairs = grouped(incidences, partitions).flatMap(lambda item: neighbour_pairs_by_record(item[1], partitions))
    counted = grouped(pairs, partitions).map(lambda item: neighbourhood_histogram(item[1]))
    return counted.fold({}, lambda first, second: merge_counts([first, second]))


# --- sampling, exclusion, survivors, files ---------------------------------------------------------


def surviving(joined: RDD, probability: float, options: batching.BatchOptions, partitions: int) -> tuple[RDD, RDD]:
    """(record partition, (JoinedPartition, Survivors)) of each joined record partition: its units
    sampled (Alg. 3 line 3), their users blocked within their partitions (line 4), what survives
    (line 5); and the samples, kept until the caller has computed the survivors. Only the units
    (`units_of`) are sampled: the content stays in its Spark partition until the survivors' rows."""
    steps, min_sep = options.sampled_steps, options.min_sep
    warm_up, training, files = options.warm_up_steps, options.steps, options.output_shards
    selected = joined.filter(lambda item: item[1].joined is not None).mapValues(lambda found: found.joined.joined)

    def sample(item: tuple[int, JoinedPartition]) -> tuple[int, SampledPartition]:
        part, partition = item
        return part, sample_partition(part, units_of(partition), probability, steps, partitions)

    sampled = selected.map(sample, preservesPartitioning=True).persist(KEPT)
    incidences = sampled.flatMap(lambda item: item[1].incidences)
    excluded = grouped(incidences, partitions).flatMap(lambda item: block_users(item[1], min_sep))

    def survive(sources: tuple[list, list, list]) -> tuple[JoinedPartition, Survivors]:
        (partition,), (samples,), excluded_pieces = sources
        return partition, survivors(partition, samples.samples, excluded_pieces, warm_up, training, files)

    return cogrouped(partitions, selected, sampled, excluded).mapValues(survive), sampled


class WrittenFile(NamedTuple):
    """A batch file a task wrote: the name its attempt wrote it under, its counts, and its rows' users
    and records by partition (for the statistics over all files)."""

    file: int
    path: str
    counts: FileCounts
    routing: WrittenRouting


class WrittenPiece(NamedTuple):
    """A piece of a batch file a task wrote (`file_pieces`): its number, the name its attempt wrote it
    under, and the counts and routing of its steps."""

    piece: int
    path: str
    counts: FileCounts
    routing: WrittenRouting


def attempt_path(staged: str, file: int, files: int) -> str:
    """Where this task attempt writes batch file `file`: a name no other attempt (a retry, a speculative
    copy, a recomputation) writes."""
    task = TaskContext.get()
    assert task is not None, "a batch file is written in a Spark task"
    final = batch_files.batch_file_path(staged, file, files)
    return f"{final}.attempt-{task.partitionId()}-{task.attemptNumber()}-{task.taskAttemptId()}"


def piece_runs(expected_rows: float, partitions: int) -> int:
    """How many pieces the batch files are written in: one per partition, and more where a piece would
    hold more than ROWS_PER_PIECE of the batches' `expected_rows`."""
    return max(partitions, math.ceil(expected_rows / ROWS_PER_PIECE))


def file_pieces(files: int, steps: int, runs: int) -> list[tuple[int, range]]:
    """(file, its steps) of every piece of the batch files, in order: each file's steps in runs, about
    `runs` runs over all files and at least one a file, which tasks write in parallel."""
    per_file = max(1, runs // files)
    pieces = []
    for file in range(files):
        whole = batch_files.step_range(file, steps, files)
        cuts = min(per_file, max(1, len(whole)))
        pieces += [(file, whole[len(whole) * cut // cuts : len(whole) * (cut + 1) // cuts]) for cut in range(cuts)]
    return pieces


def written_files(
    survived: RDD,
    staged: str,
    options: batching.BatchOptions,
    content: dict[str, Feature],
    partitions: int,
    errors_dir: str,
) -> RDD:
    """WrittenFile of every batch file, each written under `staged` by a task from its pieces (`file_pieces`):
    tasks of their own write a piece each, from every record partition's rows of its steps
    (`batch_steps.rows_of_steps`, `gathered_file_rows`, `batch_files.write_batch_file`: the bytes those
    steps have in the whole file), and the file's task joins them in step order."""
    files, max_batch_size = options.output_shards, options.max_batch_size
    pieces = file_pieces(files, options.steps, piece_runs(options.steps * options.batch_size, partitions))
    pieces_dir = storage.join(staged, "pieces")

    def rows_by_piece(item: tuple[int, tuple[JoinedPartition, Survivors]]) -> list:
        part, (partition, kept_samples) = item
        # every piece hears from every partition, so empty files are written
        return [
            (piece, (part, rows_of_steps(partition, kept_samples.written, steps)))
            for piece, (_, steps) in enumerate(pieces)
        ]

    def write_piece(item: tuple[int, Iterable]) -> tuple[int, WrittenPiece]:
        piece, rows = item
        file, steps = pieces[piece]
        path = attempt_path(pieces_dir, piece, len(pieces))
        result = batch_files.write_batch_file(path, gathered_file_rows(rows), steps, max_batch_size, content)
        return file, WrittenPiece(piece, path, result.counts, written_by_partition(result, partitions))

    def join(item: tuple[int, Iterable[WrittenPiece]]) -> WrittenFile:
        file, written = item
        in_order = sorted(written, key=lambda piece: piece.piece)

        def write(handle: Any) -> None:
            for piece in in_order:
                with storage.open_input(piece.path) as source:
                    while chunk := source.read(COPY_BYTES):
                        handle.write(chunk)

        path = attempt_path(staged, file, files)
        storage.write_whole(path, write)
        counts = FileCounts(
            np.concatenate([piece.counts.written for piece in in_order]),
            truncated=sum(piece.counts.truncated for piece in in_order),
            padding=sum(piece.counts.padding for piece in in_order),
        )
        routing = WrittenRouting(
            [pair for piece in in_order for pair in piece.routing.users],
            [pair for piece in in_order for pair in piece.routing.records],
        )
        return WrittenFile(file, path, counts, routing)

    written_pieces = grouped(survived.flatMap(rows_by_piece), len(pieces)).map(kept(errors_dir, write_piece))
    return grouped(written_pieces, files).map(kept(errors_dir, join))


# --- the jobs --------------------------------------------------------------------------------------


def _jobs(
    sc: SparkContext,
    inputs: JobInputs,
    data: str | DataFrame,
    output: str,
    options: batching.BatchOptions,
    spark_options: SparkOptions,
) -> tuple[JobRun, int]:
    """The Spark jobs that sample and write the batch files under the inputs' `work` from the records
    DATA (its files, or a DataFrame): what the driver commits once they have all passed, and the
    partitions they ran in."""
    run_dir = storage.join(inputs.work, uuid.uuid4().hex[:12])
    errors_dir, staged = storage.join(run_dir, INPUT_ERRORS), storage.join(run_dir, "batches")
    columns = inputs.bound.columns(options.columns)
    frame = as_dataframe(data)
    source = inputs.data_files if frame is None else frame
    read = read_input(sc, source, columns, spark_options.input_split_bytes, errors_dir, inputs.content)
    data_name = input_name(data)
    if options.on_invalid == "error":  # before the join, as the local engine stops
        handle_rejects(read.rejects, "error", output)
    rows = RunCounts.of(read.stats).input_rows
    partitions = spark_options.partitions_for(rows, sc.defaultParallelism, BATCH_RECORDS_PER_PARTITION)
    records = record_partitions(read.chunks, partitions)
    joined = joined_partitions(sc, records, inputs.selection, options, data_name, errors_dir).persist(KEPT)
    kept_rdds = [joined]
    try:
        with raising_kept_errors(errors_dir):
            facts = joined.values().map(join_facts).collect()
            read.reads.unpersist()  # the joined partitions hold the records
            histogram = neighbourhood_sizes(joined, partitions)
        digest = sum((f.digest for f in facts if f.digest is not None), EMPTY_GRAPH)
        batching.check_same_graph(digest, inputs.bound, data_name)  # the records must be the graph bounded
        probability = batching.calibrated_probability(histogram, options)
        rejects = rec.merge_rejects([read.rejects, *(f.rejects for f in facts)])
        if options.on_invalid == "error":  # before anything is sampled
            handle_rejects(rejects, "error", output)
        content = merged_content(f.described for f in facts if f.described is not None)
        survived, sampled = surviving(joined, probability, options, partitions)
        survived = survived.persist(KEPT)
        kept_rdds += [sampled, survived]
        zero = np.zeros(options.sampled_steps, np.int64)
        with raising_kept_errors(errors_dir):
            sampled_sizes = survived.map(lambda item: item[1][1].sampled_sizes).fold(zero, np.add)
            sampled.unpersist()
            joined.unpersist()  # the survivors hold what the files need of the joined partitions
            written = written_files(survived, staged, options, content, partitions, errors_dir).persist(KEPT)
            kept_rdds.append(written)
            files = sorted(written.map(lambda w: (w.file, w.path, w.counts)).collect())
            survived.unpersist()
            users = grouped(written.flatMap(lambda w: w.routing.users), partitions)
            participation = users.map(lambda item: batch_report.participation_of(item[1])).collect()
            keys = grouped(written.flatMap(lambda w: w.routing.records), partitions)
            written_records = keys.map(lambda item: written_record_count(list(item[1]))).sum()
    finally:
        for rdd in kept_rdds:
            rdd.unpersist()
    summary = BatchSummary(
        histogram=histogram,
        probability=probability,
        content=content,
        id_type=next(f.id_type for f in facts if f.id_type is not None),
        records=sum(f.records for f in facts),
        files=[counts for _, _, counts in files],
        sampled_sizes=sampled_sizes,
        participation=batch_report.merge_participation_stats(participation),
        written_records=int(written_records),
        rejects=rejects,
    )
    return JobRun(summary, [path for _, path, _ in files], inputs.work), partitions


def run_spark(
    selected: str, data: str | DataFrame, output: str, options: batching.BatchOptions, spark_options: SparkOptions
) -> BatchReport:
    """`madp batch --runner pyspark`: the Spark jobs on the records DATA, a path or a DataFrame
    (`madp.spark.dataframe`), in the DataFrame's session, the caller's active SparkSession or one built
    from `spark_options`; then the batch files committed, the rejects, schema and report written."""
    bounding_only = [
        each.flags[0]
        for each in declared(SparkOptions)
        if each.name in BOUNDING_ONLY and getattr(spark_options, each.name) != each.default
    ]
    if bounding_only:
        raise InputError(f"{', '.join(bounding_only)}: options of madp bound, not of madp batch (it runs no rounds)")
    if options.sampler != "minsep":
        if as_dataframe(data) is not None:
            raise InputError(f"--sampler {options.sampler} runs in this process: its DATA is a path, not a DataFrame")
        log.warning("--sampler %s runs in this process, not on Spark", options.sampler)
        return batch_local.run_local(
            selected, str(data), output, options, engine=f"local ({options.sampler} runs in the driver)"
        )
    started = time.perf_counter()
    frame = as_dataframe(data)
    inputs = job_inputs(selected, rec.list_input_files(str(data)) if frame is None else [], output, options)
    with removed_on_failure(inputs.work), spark_session(spark_options, frame) as spark:
        with fault_watch(spark.sparkContext, "madp batch") as watch:
            job, partitions = _jobs(spark.sparkContext, inputs, data, output, options, spark_options)
            faults = watch.faults()
    return commit(
        selected, input_name(data), output, options, job, storage.move_file, RUNNER, started, partitions, faults=faults
    )
