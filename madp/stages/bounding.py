"""The bounding step: records in, a selection in which no user exceeds its contribution bound out."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from madp.core.records import Columns
from madp.core.reports import BoundReport
from madp.core.selection import BoundOptions
from madp.stages.arguments import (
    LOCAL,
    PYSPARK,
    RUNNER_KEYWORDS,
    beam_arguments,
    cluster_path,
    input_paths,
    options_of,
    records_path,
    refuse_runner_options_locally,
    writing,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame


def bound(
    input: str | DataFrame, output: str, *, runner: str = LOCAL, runner_options: Sequence[str] = (), **options: Any
) -> BoundReport:
    """Bound each user's contributions: select records so that no user is in more than its bound of them.

    The step `madp bound` runs (round-based unanimous-proposal bounding), with `output` held (its lock)
    while it is written. The selection is `OUTPUT/selected/*.parquet` (id, copies) and OUTPUT/report.json;
    `madp.batch` samples training batches from it.

    Args:
        input: the records, a .jsonl/.jsonl.gz/.parquet file or a directory of them (local or a URL Beam
            reads, gs://...), each with an id and its users; or with runner "pyspark", a Spark DataFrame
            of them, run in its own session: its rows are read as a Parquet file's are, with the same
            rules, rejects and counts, row r of partition p named "<DataFrame> partition p", row r
            (`madp.spark.dataframe`; the report's input is "<DataFrame>"). Where it reads files, the
            output must not overlap them.
        output: the directory to write; an earlier bounding there is replaced once the input has passed
            its checks.
        runner: "local" (the in-memory engine, in this process), "pyspark" (madp on Apache Spark: the
            caller's active SparkSession, or one madp builds) or a Beam runner name (DirectRunner,
            PrismRunner, DataflowRunner, ...).
        runner_options: the runner's options, argv-style: Beam's pipeline options (["--project", "p",
            "--partitions", "64"]), or with "pyspark" those of `madp.spark.session.SparkOptions`
            (["--spark-master", "spark://host:7077", "--partitions", "64"]); none with runner "local".
        **options: the options of `madp bound` by their snake_case names, the fields of
            `madp.core.selection.BoundOptions`: max_contributions (K, required), order ("arity",
            "hash", "weight", "alternate"), seed, max_rounds, duplicates, capacities, output_shards,
            on_invalid ("error", "skip"), ...

    Returns:
        The bounding report, a `madp.core.reports.BoundReport` (frozen; `to_json()` is report.json's
        content, with the wall time, which the file leaves out): contribution_bound, selected_records,
        distinct_selected, max_user_contribution, rounds, converged, histograms, selection_files (each
        with its SHA-256), per_round statistics, wall_time_s, ...

    Raises:
        TypeError: an option that `madp bound` does not have (the error lists those it has).
        madp.core.errors.InputError: bad options, input rows (--on-invalid error), an output that
            overlaps the input or that another madp process is writing; the message names the option,
            file or row.

    Example:
        >>> import madp, tempfile
        >>> from madp.tools.data.synthetic import GraphSpec, generate, write_dataset
        >>> work, spec = tempfile.mkdtemp(), GraphSpec(records=400, seed=1)
        >>> _ = write_dataset(generate(spec), spec, f"{work}/records.parquet", shards=1)
        >>> report = madp.bound(f"{work}/records.parquet", f"{work}/bounded", max_contributions=3)
        >>> report.contribution_bound, report.max_user_contribution, report.converged
        (3, 3, True)
        >>> report.input_records, report.selected_records
        (400, 368)
    """
    bound_options = options_of("bound", BoundOptions, options, RUNNER_KEYWORDS)
    with writing(output, (*input_paths(input), bound_options.capacities), "bound"):
        return run_bound(input, output, bound_options, runner, runner_options)


def run_bound(
    input: str | DataFrame, output: str, options: BoundOptions, runner: str = LOCAL, runner_options: Sequence[str] = ()
) -> BoundReport:
    """`bound` with its options built (`madp bound` builds them from its arguments), on an output its
    caller holds: the report of the local engine, of the Spark jobs, or of the Beam pipeline on `runner`."""
    refuse_runner_options_locally(runner, runner_options)
    if runner == PYSPARK:
        from madp.spark.bound import run_spark
        from madp.spark.session import spark_options

        return run_spark(cluster_path(input), cluster_path(output), options, spark_options(runner_options))
    path = records_path(input, runner)
    if runner == LOCAL:
        from madp.engines.local_engine import run_local

        return run_local(path, output, options)
    from madp.engines.direct_runner import check_direct_runner_memory

    beam_args = beam_arguments(runner, runner_options)
    check_direct_runner_memory(beam_args, "madp bound")  # before Beam is imported
    from madp.beam.bound import run_beam

    return run_beam(path, output, options, beam_args)


def run_verify_bound(
    input: str,
    output: str,
    max_contributions: int,
    capacities: str | None,
    columns: Columns,
    buckets: int | None = None,
) -> dict[str, Any]:
    """`madp verify-bound` (and `madp run`'s stage of it): the independent verifier's check that no user of
    `input`'s records, read with `columns`, is in more of the selection at `output` than its bound; in
    `buckets` on disk (None: by the input's size)."""
    from madp.core.verify import verify_bound

    return verify_bound(
        input,
        output,
        max_contributions,
        capacities,
        columns.id,
        columns.users,
        columns.users_columns,
        columns.user_ids,
        buckets,
    )
