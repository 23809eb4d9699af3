"""Data in: `madp generate` (synthetic records) and `madp import-mbox` (email as records)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING

from madp.commands.registry import Family
from madp.core.options import add_options, option, options_from, seed_argument

if TYPE_CHECKING:  # madp.tools.data.synthetic imports numpy and pyarrow, which the parser does not need
    from madp.tools.data.synthetic import GraphSpec


@dataclasses.dataclass(frozen=True)
class GenerateOptions:
    """The options of `madp generate` (each field its `--flag`): the graph and content to draw (`spec`) and
    how they are written; `madp run`'s generate section takes them, its holdout as a switch."""

    records: int = option()
    task: str = option(
        "logistic",
        choices=("logistic", "text"),
        help="content: logistic-regression features and a 0/1 label, or topic-labelled texts with "
        "per-user signatures (default logistic)",
    )
    graph: str = option("skewed", choices=("regular", "skewed"))
    mean_arity: float = option(2.0, help="expected users per record (default 2)")
    records_per_user: float = option(2.0, help="expected records per user (default 2)")
    alpha: float = option(1.5, help="skew of the skewed graph (default 1.5)")
    features: int = option(16, help="dimension of the logistic-regression features")
    bias_scale: float = option(1.0, help="k: weight of the arity-dependent bias")
    shards: int = option(4, help="Parquet shards when OUTPUT is a directory")
    seed: int = option(0, parse=seed_argument)
    users_as: str = option(
        "users",
        choices=("users", "from-to-cc", "both"),
        help="write the users as a `users` list (default), as an email export holds them (`from` the first "
        "user, `to` and `cc` lists; read with --users-columns from,to,cc), or both",
    )
    holdout: str | None = option(
        None,
        help="also write a held-out test set (same task, records not in OUTPUT) to this .parquet or .jsonl file",
    )
    holdout_fraction: float = option(0.1, help="fraction of the generated records held out (default 0.1)")

    def __post_init__(self) -> None:
        self.spec  # noqa: B018 (built, the spec checks the options: a bad one is refused before anything runs)

    @property
    def spec(self) -> GraphSpec:
        """What to draw (checked as it is built)."""
        from madp.tools.data.synthetic import GraphSpec

        return GraphSpec(
            records=self.records,
            graph=self.graph,
            mean_arity=self.mean_arity,
            records_per_user=self.records_per_user,
            alpha=self.alpha,
            features=self.features,
            bias_scale=self.bias_scale,
            seed=self.seed,
            task=self.task,
        )


def add_parsers(commands: argparse._SubParsersAction) -> None:
    generate = commands.add_parser("generate", help="write a synthetic multi-user dataset (It's my data too, App. C.1)")
    generate.add_argument("output", help="a .jsonl or .parquet file, or a directory for Parquet shards")
    add_options(generate, GenerateOptions)

    mbox = commands.add_parser(
        "import-mbox",
        help="email (an mbox file) as multi-user records: every From, To, Cc and Bcc address (and Resent-*)",
    )
    mbox.add_argument("mbox", help="an mbox file")
    mbox.add_argument("output", help="directory: records/ (Parquet), rejected.jsonl, report.json")


def generate(output: str, options: GenerateOptions) -> dict:
    """Draw the records `options` describe and write them to `output` (and the held-out ones to
    `options.holdout`): what `madp generate` and `madp run`'s generate stage run."""
    from madp.tools.data.synthetic import write_generated

    return write_generated(
        options.spec, output, options.shards, options.holdout, options.holdout_fraction, options.users_as
    )


def _generate(args: argparse.Namespace, unknown: list[str]) -> dict:
    return generate(args.output, options_from(GenerateOptions, args))


def _import_mbox(args: argparse.Namespace, unknown: list[str]) -> dict:
    from madp.tools.data.mbox import import_mbox

    return import_mbox(args.mbox, args.output)


FAMILY = Family(add_parsers, {"generate": _generate, "import-mbox": _import_mbox})
