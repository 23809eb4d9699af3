"""Batch materialization: `madp batch` and its independent check `madp verify-batches`."""

from __future__ import annotations

import argparse

from madp.commands.registry import Family, add_options, options_from
from madp.core.records import ColumnOptions
from madp.engines.batching import BatchOptions


def add_parsers(commands: argparse._SubParsersAction) -> None:
    batch = commands.add_parser(
        "batch",
        help="materialize training batches as TFRecords (b-min-sep Poisson sampling or min-sep greedy)",
        description="Unknown options are passed to Beam (e.g. --project ..., --temp_location ...), among "
        "them madp's own --partitions P (record and user partitions, default 16).",
    )
    batch.add_argument("selected", help="a `madp bound` output directory (selected/*.parquet: id, copies)")
    batch.add_argument("data", help="the records: a .jsonl/.parquet file or a directory of them")
    batch.add_argument("output", help="output directory: batches-*.tfrecord, schema.json, report.json")
    add_options(batch, BatchOptions)
    batch.add_argument("--runner", default="DirectRunner", help="'local' (in-process) or a Beam runner name")

    verify_batches = commands.add_parser("verify-batches", help="independently check batches against the records")
    verify_batches.add_argument("output", help="a `madp batch` output directory")
    verify_batches.add_argument("data", help="the records the batches were made from")
    verify_batches.add_argument("--min-sep", type=int, required=True)
    verify_batches.add_argument(
        "--selected",
        required=True,
        help="the `madp bound` output the batches were made from: every real row must be one of its selected "
        "records, in no step more often than its copies",
    )
    verify_batches.add_argument(
        "--max-contributions",
        "-k",
        type=int,
        required=True,
        help="K: the contribution bound the training accounts with (the bound's contribution_bound): no user's "
        "selected records may have more copies in all, whichever the batches hold",
    )
    verify_batches.add_argument(
        "--capacities",
        help="the bound's --capacities file: a user it lists may have its capacity in copies instead of K (as "
        "verify-bound checks it)",
    )
    verify_batches.add_argument("--max-participations", type=int, help="k: steps per user at most")
    verify_batches.add_argument("--max-batch-size", type=int, help="B_max: rows per step at most")
    add_options(verify_batches, ColumnOptions)


def _batch(args: argparse.Namespace, beam_args: list[str]) -> dict:
    """The batch report as printed: batch sizes without the per-step lists (they stay in report.json)."""
    from madp.stages.batching import run_batch

    result = run_batch(
        args.selected, args.data, args.output, options_from(BatchOptions, args), args.runner, beam_args
    ).to_json()
    for sizes in ("batch_sizes", "written_batch_sizes"):
        result[sizes] = {k: v for k, v in result[sizes].items() if k != "per_step"}
    return result


def _verify(args: argparse.Namespace, unknown: list[str]) -> dict:
    from madp.stages.batching import run_verify_batches

    return run_verify_batches(
        args.output,
        args.data,
        options_from(ColumnOptions, args).columns,
        min_sep=args.min_sep,
        max_participations=args.max_participations,
        max_batch_size=args.max_batch_size,
        selected=args.selected,
        max_contributions=args.max_contributions,
        capacities=args.capacities,
    )


FAMILY = Family(
    add_parsers,
    {"batch": _batch, "verify-batches": _verify},
    beam_options=frozenset({"batch"}),
)
