"""The in-process engine: the bounding kernels on the whole graph as one partition."""

from __future__ import annotations

import dataclasses
import gzip
import logging
import time
import zlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from madp.core import record_reading, storage
from madp.core import records as rec
from madp.core.bounding import Capacities, Control, build_user_side, preference_keys, run_steps
from madp.core.errors import check_memory
from madp.core.graph_digest import graph_digest
from madp.core.progress import Progress
from madp.core.reports import BoundReport, RoundStats
from madp.core.selection import (
    BoundOptions,
    BoundOutcome,
    InputFigures,
    alternate_runs,
    bound_report,
    group_sizes,
    handle_rejects,
    prepare_output,
    read_capacities,
    record_distribution_stats,
    selection_manifest,
    selection_shards,
    shard_path,
    user_distribution_stats,
    write_report,
    write_selection_shard,
)

log = logging.getLogger("madp.bound")


@dataclasses.dataclass
class BoundResult:
    copies: np.ndarray  # per record of the input chunk
    rounds: list[RoundStats]  # per round: pass, selected, still-eligible records
    passes: int
    converged: bool
    max_user_contribution: int
    input_users: int
    user_degree: np.ndarray  # records per user in the input
    user_contribution: np.ndarray  # selected records (copies) per user


def bound_records(chunk: rec.RecordChunk, options: BoundOptions, capacities: Capacities) -> BoundResult:
    """Alg. 1 to convergence (or max_rounds); with duplicates, passes over residual capacities (Alg. 3)."""
    n, arity = len(chunk), chunk.arity
    if options.order == "alternate" and options.group_sizes is None:  # this chunk is the whole input
        options = dataclasses.replace(options, group_sizes=group_sizes(arity, options.alternate[0]))
    keys = preference_keys(chunk.ids, arity, options.order, options.seed, chunk.weights, alternate_runs(options))
    inc_record = np.repeat(np.arange(n, dtype=np.int64), arity)
    users = build_user_side(
        chunk.users,
        inc_record,
        np.arange(n, dtype=np.int64),
        keys,
        capacities,
        copies=np.zeros(n, dtype=np.int64),
        in_pass=np.zeros(n, dtype=bool),
    )
    copies = np.zeros(n, dtype=np.int64)

    def add_copies(selected: np.ndarray) -> None:
        copies[selected] += 1

    control = run_steps(
        users, arity, np.ones(n, dtype=bool), Control(options.duplicates, options.max_rounds), add_copies
    )
    contribution = users.contribution
    return BoundResult(
        copies=copies,
        rounds=list(control.per_round),
        passes=control.passes,
        converged=control.converged,
        max_user_contribution=int(contribution.max()) if len(contribution) else 0,
        input_users=len(users.residual),
        user_degree=np.bincount(users.inc_user, minlength=len(users.residual)),
        user_contribution=contribution,
    )


# Peak resident bytes of the local engine per input record: `madp bound --runner local` on 10M records with
# 16 features peaked at 3.9 GB.
BYTES_PER_RECORD = 390
_SAMPLED_BYTES = 1 << 20  # the start of a JSON Lines file read to tell its bytes per row
CLUSTER_RUNNERS = (
    "--runner pyspark (Spark, on any cluster) or a Beam runner (--runner DataflowRunner, FlinkRunner, ...)"
)


def estimated_rows(path: str) -> int:
    """About how many rows an input file holds, before it is read: a Parquet file's row count (its
    metadata), a JSON Lines file's size over the bytes per line of its first MiB (a gzipped one's,
    compressed bytes over the lines they held); 0 for a file that cannot be read so far, which the reader
    then names."""
    try:
        return _estimated_rows(path)
    except (OSError, EOFError, zlib.error, pa.ArrowInvalid):
        return 0


def _estimated_rows(path: str) -> int:
    if path.endswith(".parquet"):
        with storage.open_input(path) as handle:
            return pq.ParquetFile(handle).metadata.num_rows
    with storage.open_input(path) as handle:
        if path.endswith(".gz"):
            with gzip.GzipFile(fileobj=handle) as unzipped:
                lines = unzipped.read(_SAMPLED_BYTES).count(b"\n")
            sampled = handle.tell()
        else:
            sample = handle.read(_SAMPLED_BYTES)
            lines, sampled = sample.count(b"\n"), len(sample)
    return round(storage.size(path) * max(lines, 1) / max(sampled, 1))


def check_local_memory(files: list[str], input_path: str, job: str) -> None:
    """Refuse, before reading, an input that the local engine (`job`, e.g. "madp bound --runner local")
    could not hold in this machine's memory (`errors.check_memory`, at BYTES_PER_RECORD per row), naming
    the engines that can."""
    rows = sum(estimated_rows(path) for path in files)
    check_memory(
        rows * BYTES_PER_RECORD,
        f"{job} on about {rows:,} records ({input_path}) holds",
        f"run it with {CLUSTER_RUNNERS}",
    )


def read_input(
    input_path: str, columns: rec.Columns, content: record_reading.Content = None, job: str | None = None
) -> tuple[rec.RecordChunk, rec.Rejects, int, int]:
    """All valid records of the input (with `content` columns), the rejected rows, rows read and
    repeated users removed; with `job` (the command that reads them), an input past this machine's memory
    is refused first (`check_local_memory`)."""
    files = rec.list_input_files(input_path)
    if job is not None:
        check_local_memory(files, input_path, job)
    chunks, facts, rejects, rows_read, removed = [], [], rec.Rejects(), 0, 0
    progress = Progress(log, "reading input", len(files), "files")
    for index, path in enumerate(files):
        result = record_reading.read_file(path, index, columns, content)
        chunks.append(result.chunk)
        facts.append(result.facts)
        rejects.extend(result.rejects)
        rows_read += result.rows_read
        removed += result.repeated_users_removed
        progress.update(index + 1, f", {rows_read} rows")
    schema = record_reading.check_facts(facts, columns, content)
    chunks = [record_reading.conform_content(chunk, schema) for chunk in chunks]
    chunk = rec.reject_duplicates(rec.merge_chunks(chunks), rejects)
    return chunk, rejects, rows_read, removed


def run_local(input_path: str, output: str, options: BoundOptions) -> BoundReport:
    """`madp bound --runner local`: read, validate, bound, write selection and report. An earlier run's
    selection and report are replaced once every check has passed: the capacities, the input's files,
    columns and types, the capacities against its user ids. Invalid rows (--on-invalid error) remove them
    (as on Beam): no selection of an earlier input outlives a re-run on an input that now has a bad row. The
    trainings ledger (OUTPUT/trainings.jsonl) is never removed."""
    started = time.perf_counter()
    capacities = (
        read_capacities(options.capacities, options.max_contributions)
        if options.capacities
        else Capacities(default=options.max_contributions)
    )
    chunk, rejects, rows_read, removed = read_input(input_path, options.columns, job="madp bound --runner local")
    if options.capacities and len(chunk.users):  # a capacity names a user of the input's id type only
        capacities.typed_as(chunk.users.type)
    if options.on_invalid == "error" and len(rejects):
        prepare_output(output)
        handle_rejects(rejects, options.on_invalid, output)
    if options.order == "alternate":
        options = dataclasses.replace(options, group_sizes=group_sizes(chunk.arity, options.alternate[0]))
    result = bound_records(chunk, options, capacities)
    prepare_output(output)  # every check passed
    handle_rejects(rejects, options.on_invalid, output)
    selected = result.copies > 0
    shards = options.shards(len(chunk))
    tables = selection_shards(chunk.ids.filter(selected), result.copies[selected], shards)
    for shard, table in tables.items():
        write_selection_shard(shard_path(output, shard, shards), table)
    graph = graph_digest(chunk.ids, chunk.offsets, chunk.users)  # the graph bounded: what `madp batch` checks
    report = bound_report(
        options,
        "local",
        input_path,
        InputFigures(rows_read, len(chunk), result.input_users, rejects, removed),
        graph,
        BoundOutcome(
            selected_records=int(result.copies.sum()),
            distinct_selected=int(selected.sum()),
            max_user_contribution=result.max_user_contribution,
            per_round=tuple(result.rounds),
            passes=result.passes,
            converged=result.converged,
            stats={
                **user_distribution_stats(result.user_degree, result.user_contribution),
                **record_distribution_stats(chunk.arity, result.copies),
            },
        ),
        selection_manifest(output, shards),
    )
    write_report(output, report)
    return dataclasses.replace(report, wall_time_s=round(time.perf_counter() - started, 3))
