"""Data in: `madp generate` (synthetic records) and `madp import-mbox` (email as records)."""

from __future__ import annotations

import argparse

from madp.commands.registry import Family
from madp.core.options import seed_argument


def add_parsers(commands: argparse._SubParsersAction) -> None:
    generate = commands.add_parser("generate", help="write a synthetic multi-user dataset (It's my data too, App. C.1)")
    generate.add_argument("output", help="a .jsonl or .parquet file, or a directory for Parquet shards")
    generate.add_argument("--records", type=int, required=True)
    generate.add_argument(
        "--task",
        choices=("logistic", "text"),
        default="logistic",
        help="content: logistic-regression features and a 0/1 label, or topic-labelled texts with "
        "per-user signatures (default logistic)",
    )
    generate.add_argument("--graph", choices=("regular", "skewed"), default="skewed")
    generate.add_argument("--mean-arity", type=float, default=2.0, help="expected users per record (default 2)")
    generate.add_argument("--records-per-user", type=float, default=2.0, help="expected records per user (default 2)")
    generate.add_argument("--alpha", type=float, default=1.5, help="skew of the skewed graph (default 1.5)")
    generate.add_argument("--features", type=int, default=16, help="dimension of the logistic-regression features")
    generate.add_argument("--bias-scale", type=float, default=1.0, help="k: weight of the arity-dependent bias")
    generate.add_argument("--shards", type=int, default=4, help="Parquet shards when OUTPUT is a directory")
    generate.add_argument("--seed", type=seed_argument, default=0)
    generate.add_argument(
        "--users-as",
        choices=("users", "from-to-cc", "both"),
        default="users",
        help="write the users as a `users` list (default), as an email export holds them (`from` the first "
        "user, `to` and `cc` lists; read with --users-columns from,to,cc), or both",
    )
    generate.add_argument(
        "--holdout",
        help="also write a held-out test set (same task, records not in OUTPUT) to this .parquet or .jsonl file",
    )
    generate.add_argument(
        "--holdout-fraction", type=float, default=0.1, help="fraction of the generated records held out (default 0.1)"
    )

    mbox = commands.add_parser(
        "import-mbox",
        help="email (an mbox file) as multi-user records: every From, To, Cc and Bcc address (and Resent-*)",
    )
    mbox.add_argument("mbox", help="an mbox file")
    mbox.add_argument("output", help="directory: records/ (Parquet), rejected.jsonl, report.json")


def _graph_spec(args: argparse.Namespace):
    from madp.tools.data.synthetic import GraphSpec

    return GraphSpec(
        records=args.records,
        graph=args.graph,
        mean_arity=args.mean_arity,
        records_per_user=args.records_per_user,
        alpha=args.alpha,
        features=args.features,
        bias_scale=args.bias_scale,
        seed=args.seed,
        task=args.task,
    )


def _generate(args: argparse.Namespace, unknown: list[str]) -> dict:
    from madp.tools.data.synthetic import generate, write_dataset

    spec = _graph_spec(args)
    return write_dataset(
        generate(spec), spec, args.output, args.shards, args.holdout, args.holdout_fraction, args.users_as
    )


def _import_mbox(args: argparse.Namespace, unknown: list[str]) -> dict:
    from madp.tools.data.mbox import import_mbox

    return import_mbox(args.mbox, args.output)


FAMILY = Family(add_parsers, {"generate": _generate, "import-mbox": _import_mbox}, {"generate": _graph_spec})
