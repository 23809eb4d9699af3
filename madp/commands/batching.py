"""Batch materialization: `madp batch` and its independent check `madp verify-batches`."""

from __future__ import annotations

import argparse
import dataclasses

from madp.commands.bounding import buckets_option, check_buckets
from madp.commands.registry import Family
from madp.core.options import add_options, option, options_from
from madp.core.records import ColumnOptions
from madp.engines.batching import BatchOptions


@dataclasses.dataclass(frozen=True)
class VerifyBatchesOptions(ColumnOptions):
    """The options of `madp verify-batches` (each field its `--flag`): what the batches must keep."""

    min_sep: int = option()
    selected: str = option(
        help="the `madp bound` output the batches were made from: every real row must be one of its selected "
        "records, in no step more often than its copies",
    )
    max_contributions: int = option(
        aliases=("-k",),
        help="K: the contribution bound the training accounts with (the bound's contribution_bound): no user's "
        "selected records may have more copies in all, whichever the batches hold",
    )
    capacities: str | None = option(
        None,
        help="the bound's --capacities file: a user it lists may have its capacity in copies instead of K (as "
        "verify-bound checks it)",
    )
    max_participations: int | None = option(None, help="k: steps per user at most")
    max_batch_size: int | None = option(None, help="B_max: rows per step at most")
    buckets: int | None = buckets_option()

    def __post_init__(self) -> None:
        super().__post_init__()
        check_buckets(self.buckets)


def add_parsers(commands: argparse._SubParsersAction) -> None:
    batch = commands.add_parser(
        "batch",
        help="materialize training batches as TFRecords (b-min-sep Poisson sampling or min-sep greedy)",
        description="Unknown options are passed to Beam (e.g. --project ..., --temp_location ...), among "
        "them madp's own --partitions P (record and user partitions, default 16); with --runner pyspark they "
        "are the Spark options (--spark-master, --spark-conf KEY=VALUE, --partitions, --input-split-bytes).",
    )
    batch.add_argument("selected", help="a `madp bound` output directory (selected/*.parquet: id, copies)")
    batch.add_argument("data", help="the records: a .jsonl/.parquet file or a directory of them")
    batch.add_argument("output", help="output directory: batches-*.tfrecord, schema.json, report.json")
    add_options(batch, BatchOptions)
    batch.add_argument(
        "--runner",
        default="DirectRunner",
        help="'local' (in-process), 'pyspark' (madp on Apache Spark: --spark-master, --spark-conf, --partitions, "
        "--input-split-bytes) or a Beam runner name",
    )

    verify_batches = commands.add_parser("verify-batches", help="independently check batches against the records")
    verify_batches.add_argument("output", help="a `madp batch` output directory")
    verify_batches.add_argument("data", help="the records the batches were made from")
    add_options(verify_batches, VerifyBatchesOptions)


def _batch(args: argparse.Namespace, runner_options: list[str]) -> dict:
    """The batch report as printed: batch sizes without the per-step lists (they stay in report.json)."""
    from madp.stages.batching import run_batch

    result = run_batch(
        args.selected, args.data, args.output, options_from(BatchOptions, args), args.runner, runner_options
    ).to_json()
    for sizes in ("batch_sizes", "written_batch_sizes"):
        result[sizes] = {k: v for k, v in result[sizes].items() if k != "per_step"}
    return result


def _verify(args: argparse.Namespace, unknown: list[str]) -> dict:
    from madp.stages.batching import run_verify_batches

    options = options_from(VerifyBatchesOptions, args)
    return run_verify_batches(
        args.output,
        args.data,
        options.columns,
        min_sep=options.min_sep,
        max_participations=options.max_participations,
        max_batch_size=options.max_batch_size,
        selected=options.selected,
        max_contributions=options.max_contributions,
        capacities=options.capacities,
        buckets=options.buckets,
    )


FAMILY = Family(
    add_parsers,
    {"batch": _batch, "verify-batches": _verify},
    runner_options=frozenset({"batch"}),
)
