"""Batch materialization: `madp batch` and its independent check `madp verify-batches`."""

from __future__ import annotations

import argparse

from madp.commands.registry import Family, add_columns, columns_of, seed_argument


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
    batch.add_argument("--steps", type=int, required=True, help="T: training steps (batches)")
    batch.add_argument(
        "--batch-size",
        type=float,
        required=True,
        help="B: expected batch size (minsep) or exact batch size (minsep-greedy)",
    )
    batch.add_argument(
        "--sampler",
        choices=("minsep", "minsep-greedy", "users"),
        default="minsep",
        help="minsep: multi-attribution b-min-sep Poisson sampling (default); "
        "minsep-greedy: deterministic batches of exactly B; users: Poisson sampling of "
        "users (single-attribution records), B = expected users per step",
    )
    batch.add_argument(
        "--min-sep",
        type=int,
        default=1,
        help="b: steps between a user's participations (default 1: plain Poisson sampling)",
    )
    batch.add_argument("--warm-up", type=int, help="minsep: simulated steps dropped first (default b-1: stationary)")
    batch.add_argument(
        "--max-batch-size",
        type=int,
        help="B_max: truncate larger batches at random, pad smaller ones with weight-0 rows",
    )
    batch.add_argument(
        "--find-max-min-sep",
        action="store_true",
        help="minsep-greedy: use the largest b for which the greedy finds a solution",
    )
    batch.add_argument(
        "--seed",
        type=seed_argument,
        help="TESTING ONLY: reproduce the sampling from this seed; the batches are then not private "
        "(default: a fresh secret key per run, never written)",
    )
    batch.add_argument(
        "--content-columns",
        help="comma-separated columns to carry (default: every column of DATA but id, users and weight)",
    )
    batch.add_argument(
        "--on-invalid",
        choices=("error", "skip"),
        default="error",
        help="invalid DATA rows: stop (default) or skip them into OUTPUT/rejected/",
    )
    batch.add_argument("--output-shards", type=int, default=1, help="TFRecord files (contiguous step ranges)")
    batch.add_argument("--runner", default="DirectRunner", help="'local' (in-process) or a Beam runner name")
    add_columns(batch)

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
    add_columns(verify_batches)


def _batch_options(args: argparse.Namespace):
    from madp.engines.batching import BatchOptions

    content = None if args.content_columns is None else tuple(c for c in args.content_columns.split(",") if c)
    return BatchOptions(
        steps=args.steps,
        batch_size=args.batch_size,
        sampler=args.sampler,
        min_sep=args.min_sep,
        warm_up=args.warm_up,
        max_batch_size=args.max_batch_size,
        find_max_min_sep=args.find_max_min_sep,
        seed=args.seed,
        columns=columns_of(args),
        content_columns=content,
        on_invalid=args.on_invalid,
        output_shards=args.output_shards,
    )


def _batch(args: argparse.Namespace, beam_args: list[str]) -> dict:
    """The batch report as printed: batch sizes without the per-step lists (they stay in report.json)."""
    from madp.stages.batching import run_batch

    result = run_batch(args.selected, args.data, args.output, _batch_options(args), args.runner, beam_args).to_json()
    for sizes in ("batch_sizes", "written_batch_sizes"):
        result[sizes] = {k: v for k, v in result[sizes].items() if k != "per_step"}
    return result


def _verify(args: argparse.Namespace, unknown: list[str]) -> dict:
    from madp.core.verify import verify_batches

    columns = columns_of(args)
    return verify_batches(
        args.output,
        args.data,
        args.min_sep,
        args.max_participations,
        args.max_batch_size,
        columns.id,
        columns.users,
        selected=args.selected,
        max_contributions=args.max_contributions,
        users_columns=columns.users_columns,
        user_ids=columns.user_ids,
        capacities_path=args.capacities,
    )


FAMILY = Family(
    add_parsers,
    {"batch": _batch, "verify-batches": _verify},
    {"batch": _batch_options},
    frozenset({"batch"}),
)
