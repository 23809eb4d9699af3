"""Contribution bounding: `madp bound` and its independent check `madp verify-bound`."""

from __future__ import annotations

import argparse

from madp.commands.registry import Family, add_columns, columns_of, seed_argument


def add_parsers(commands: argparse._SubParsersAction) -> None:
    bound = commands.add_parser(
        "bound",
        allow_abbrev=False,
        help="select records so that no user exceeds its contribution bound",
        description="Round-based unanimous-proposal contribution bounding. Arguments this command does not "
        "know are passed to Apache Beam as pipeline options (e.g. --project, --region, "
        "--temp_location, --flink_master, --setup_file), among them madp's own: --partitions P "
        "(record and user partitions, default 16; several per worker core), --rounds-per-pipeline R "
        "(iterations unrolled in one pipeline run, default 10) and --local-finish-incidences N (one "
        "worker finishes once at most N undecided incidences are left, default 2000000).",
    )
    bound.add_argument("input", help="a .jsonl/.parquet file or a directory of them")
    bound.add_argument("output", help="output directory: selected/, report.json, rejected/")
    bound.add_argument("--max-contributions", "-k", type=int, required=True, help="K: records per user at most")
    bound.add_argument(
        "--order",
        choices=("arity", "hash", "weight", "alternate"),
        default="arity",
        help="universal preference: fewer users first (default), seeded hash, higher weight first, "
        "or alternate runs of small and large records (bias mitigation)",
    )
    bound.add_argument("--weight-column", help="column of record weights for --order weight")
    bound.add_argument(
        "--arity-threshold",
        type=int,
        help="--order alternate: u, records with at most u users are 'small' (It's my data too, 5.5)",
    )
    bound.add_argument("--small-run", type=int, help="--order alternate: c1, small records per run")
    bound.add_argument("--large-run", type=int, help="--order alternate: c2, large records per run")
    bound.add_argument("--seed", type=seed_argument, default=0, help="seed of the hash that breaks ties in the order")
    bound.add_argument("--capacities", help="file (.csv/.jsonl/.parquet) of rows user, capacity overriding K")
    bound.add_argument("--max-rounds", type=int, help="stop after R rounds (default: until converged)")
    bound.add_argument(
        "--duplicates",
        action="store_true",
        help="with-duplicates variant: passes over residual capacities; records get copies",
    )
    bound.add_argument(
        "--on-invalid",
        choices=("error", "skip"),
        default="error",
        help="invalid rows stop the run (default) or are skipped into OUTPUT/rejected/",
    )
    bound.add_argument(
        "--output-shards",
        type=int,
        help="Parquet files in OUTPUT/selected/ (default: one per 1,000,000 valid input records)",
    )
    bound.add_argument(
        "--runner",
        default="DirectRunner",
        help="'local' (in-process) or a Beam runner: DirectRunner (default), DataflowRunner, "
        "FlinkRunner, SparkRunner, ...",
    )
    add_columns(bound)

    verify = commands.add_parser("verify-bound", help="independently check a bounding output against its input")
    verify.add_argument("input")
    verify.add_argument("output", help="a `madp bound` output directory")
    verify.add_argument("--max-contributions", "-k", type=int, required=True)
    verify.add_argument("--capacities")
    add_columns(verify)


def _bound_options(args: argparse.Namespace):
    from madp.core.selection import BoundOptions

    return BoundOptions(
        max_contributions=args.max_contributions,
        order=args.order,
        seed=args.seed,
        max_rounds=args.max_rounds,
        duplicates=args.duplicates,
        columns=columns_of(args, args.weight_column),
        on_invalid=args.on_invalid,
        capacities=args.capacities,
        output_shards=args.output_shards,
        arity_threshold=args.arity_threshold,
        small_run=args.small_run,
        large_run=args.large_run,
    )


def _bound(args: argparse.Namespace, beam_args: list[str]) -> dict:
    """The bound's report as printed: without its per-round statistics (they stay in report.json)."""
    from madp.stages.bounding import run_bound

    result = run_bound(args.input, args.output, _bound_options(args), args.runner, beam_args).to_json()
    return {k: v for k, v in result.items() if k != "per_round"}


def _verify(args: argparse.Namespace, unknown: list[str]) -> dict:
    from madp.core.verify import verify_bound

    columns = columns_of(args)
    return verify_bound(
        args.input,
        args.output,
        args.max_contributions,
        args.capacities,
        columns.id,
        columns.users,
        columns.users_columns,
        columns.user_ids,
    )


FAMILY = Family(
    add_parsers,
    {"bound": _bound, "verify-bound": _verify},
    {"bound": _bound_options},
    frozenset({"bound"}),
)
