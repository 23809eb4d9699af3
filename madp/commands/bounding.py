"""Contribution bounding: `madp bound` and its independent check `madp verify-bound`."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from madp.commands.registry import Family
from madp.core.errors import OptionError
from madp.core.options import add_options, option, options_from
from madp.core.records import ColumnOptions
from madp.core.selection import BoundOptions


def buckets_option() -> Any:
    """The verifiers' --buckets: in how many parts they check the records, one in memory at a time."""
    return option(
        None,
        help="check the records in this many buckets on disk, one in memory at a time (default one per 128 MiB "
        "of them)",
    )


def check_buckets(buckets: int | None) -> None:
    if buckets is not None and buckets < 1:
        raise OptionError("--buckets must be at least 1")


@dataclasses.dataclass(frozen=True)
class VerifyBoundOptions(ColumnOptions):
    """The options of `madp verify-bound` (each field its `--flag`): the bound the output must keep."""

    max_contributions: int = option(aliases=("-k",))
    capacities: str | None = option(None)
    buckets: int | None = buckets_option()

    def __post_init__(self) -> None:
        super().__post_init__()
        check_buckets(self.buckets)


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
    add_options(bound, BoundOptions)
    bound.add_argument(
        "--runner",
        default="DirectRunner",
        help="'local' (in-process), 'pyspark' (madp on Apache Spark: --spark-master URL, --spark-conf "
        "KEY=VALUE, --partitions P, ...) or a Beam runner: DirectRunner (default), DataflowRunner, "
        "FlinkRunner, SparkRunner, ...",
    )

    verify = commands.add_parser("verify-bound", help="independently check a bounding output against its input")
    verify.add_argument("input")
    verify.add_argument("output", help="a `madp bound` output directory")
    add_options(verify, VerifyBoundOptions)


def _bound(args: argparse.Namespace, runner_options: list[str]) -> dict:
    """The bound's report as printed: without its per-round statistics (they stay in report.json)."""
    from madp.stages.bounding import run_bound

    result = run_bound(args.input, args.output, options_from(BoundOptions, args), args.runner, runner_options).to_json()
    return {k: v for k, v in result.items() if k != "per_round"}


def _verify(args: argparse.Namespace, unknown: list[str]) -> dict:
    from madp.stages.bounding import run_verify_bound

    options = options_from(VerifyBoundOptions, args)
    return run_verify_bound(
        args.input, args.output, options.max_contributions, options.capacities, options.columns, options.buckets
    )


FAMILY = Family(
    add_parsers,
    {"bound": _bound, "verify-bound": _verify},
    runner_options=frozenset({"bound"}),
)
