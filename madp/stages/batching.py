"""The batching step: a selection and its records in, the training batches as TFRecords out."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from madp.core.records import Columns
from madp.core.reports import BatchReport
from madp.engines.batching import BatchOptions
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


def batch(
    selected: str,
    data: str | DataFrame,
    output: str,
    *,
    runner: str = LOCAL,
    runner_options: Sequence[str] = (),
    **options: Any,
) -> BatchReport:
    """Materialize the training batches of a selection: which records each step trains on, as TFRecords.

    The step `madp batch` runs (b-min-sep Poisson sampling by default; min-sep greedy batches or user
    sampling), with `output` held (its lock) while it is written: `OUTPUT/batches-*.tfrecord`, schema.json
    and report.json, which `madp.calibrate` and `madp.train` read.

    Args:
        selected: a `madp.bound` output directory (`selected/*.parquet` and its report).
        data: the records that were bounded (the same graph: its digest is checked): their path, or with
            runner "pyspark" a Spark DataFrame of them, read as `madp.bound` reads one (the report's data
            is "<DataFrame>"); its other columns are the content, as a file's.
        output: the directory to write; earlier batches there are replaced once the checks have passed.
        runner: "local" (the in-memory engine, in this process), "pyspark" (madp on Apache Spark: the
            caller's active SparkSession, or one built from the options) or a Beam runner name
            (DirectRunner, PrismRunner, DataflowRunner, ...).
        runner_options: the runner's options, argv-style: Beam's pipeline options, or with "pyspark" those
            of `madp.spark.session.SparkOptions` (["--spark-master", "spark://host:7077", "--partitions",
            "64"]); none with runner "local".
        **options: the options of `madp batch` by their snake_case names, the fields of
            `madp.engines.batching.BatchOptions`: steps (T) and batch_size (B), both required; sampler
            ("minsep", "minsep-greedy", "users"), min_sep (b), warm_up, max_batch_size (B_max), seed
            (TESTING ONLY: reproducible, not private; default a fresh secret key), content_columns (a
            tuple), on_invalid, output_shards, ...

    Returns:
        The batch report, a `madp.core.reports.BatchReport` (frozen; `to_json()` is report.json's
        content): sampler, sampling, sampling_probability, expected_batch_size, steps, batch_sizes and
        written_batch_sizes (with their per_step tuples), participation, files (each with its SHA-256),
        the bound's record, wall_time_s, ...

    Raises:
        TypeError: an option that `madp batch` does not have (the error lists those it has).
        madp.core.errors.InputError: bad options, a selection of another graph than `data`, invalid rows
            (on_invalid "error"), a sampling that does not fit in memory, an output that overlaps an input
            or that another madp process is writing; the message names the option, file or row.

    Example:
        >>> import madp, tempfile
        >>> from madp.tools.data.synthetic import GraphSpec, generate, write_dataset
        >>> work, spec = tempfile.mkdtemp(), GraphSpec(records=400, seed=1)
        >>> _ = write_dataset(generate(spec), spec, f"{work}/records.parquet", shards=1)
        >>> _ = madp.bound(f"{work}/records.parquet", f"{work}/bounded", max_contributions=3)
        >>> report = madp.batch(
        ...     f"{work}/bounded", f"{work}/records.parquet", f"{work}/batches",
        ...     steps=12, batch_size=8, min_sep=2, seed=0,  # seed: reproducible, NOT private
        ... )
        >>> report.steps, round(report.expected_batch_size, 6), report.participation.min_gap
        (12, 8.0, 2)
    """
    batch_options = options_of("batch", BatchOptions, options, RUNNER_KEYWORDS)
    with writing(output, (selected, *input_paths(data)), "batch"):
        return run_batch(selected, data, output, batch_options, runner, runner_options)


def run_batch(
    selected: str,
    data: str | DataFrame,
    output: str,
    options: BatchOptions,
    runner: str = LOCAL,
    runner_options: Sequence[str] = (),
) -> BatchReport:
    """`batch` with its options built (`madp batch` builds them from its arguments), on an output its
    caller holds: the report of the local engine, of the Spark jobs or of the Beam pipeline on `runner`."""
    refuse_runner_options_locally(runner, runner_options)
    if runner == PYSPARK:
        from madp.spark.batch import run_spark
        from madp.spark.session import spark_options

        return run_spark(
            cluster_path(selected), cluster_path(data), cluster_path(output), options, spark_options(runner_options)
        )
    path = records_path(data, runner)
    if runner == LOCAL:
        from madp.engines.batch_local import run_local

        return run_local(selected, path, output, options)
    from madp.engines.batch_local import BYTES_PER_SAMPLE
    from madp.engines.direct_runner import check_direct_runner_memory

    beam_args = beam_arguments(runner, runner_options)
    rows = float(options.sampled_steps) * options.batch_size  # the local engine's estimate, as it samples
    check_direct_runner_memory(  # before Beam is imported
        beam_args,
        "madp batch",
        rows * BYTES_PER_SAMPLE,
        f"--steps {options.steps} with --batch-size {options.batch_size:g} sampling about {rows:.3g} rows",
    )
    from madp.beam.batch import run_beam

    return run_beam(selected, path, output, options, beam_args)


def run_verify_batches(
    output: str,
    data: str,
    columns: Columns,
    *,
    min_sep: int,
    max_participations: int | None,
    max_batch_size: int | None,
    selected: str,
    max_contributions: int,
    capacities: str | None,
    buckets: int | None = None,
) -> dict[str, Any]:
    """`madp verify-batches` (and `madp run`'s stage of it): the independent verifier's check of the batches at
    `output` against `data`'s records, read with `columns`, and the selection they were sampled from; in
    `buckets` on disk (None: by the records' size)."""
    from madp.core.verify import verify_batches

    return verify_batches(
        output,
        data,
        min_sep,
        max_participations,
        max_batch_size,
        columns.id,
        columns.users,
        selected=selected,
        max_contributions=max_contributions,
        users_columns=columns.users_columns,
        user_ids=columns.user_ids,
        capacities_path=capacities,
        buckets=buckets,
    )
