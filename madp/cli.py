"""The `madp` command line: thin wrappers over the library."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from collections.abc import Mapping

from madp import storage
from madp.errors import CheckFailed
from madp.records import Columns, InputError

LOCAL = "local"
log = logging.getLogger("madp")


def _add_columns(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--id-column", default="id", help="column holding the record id (default: id)")
    parser.add_argument("--users-column", default="users", help="column holding the list of user ids (default: users)")


def _add_mechanism(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--mechanism",
        choices=("dpsgd", "dpsgd-uls", "bandmf", "bandmf-minsep", "bandmf-cyclic"),
        required=True,
        help="dpsgd: example-level Poisson sampling, k records per user (mixture of Gaussians); "
        "dpsgd-uls: user-level Poisson sampling; bandmf: BandMF on (k, b)-min-sep batches, "
        "unamplified; bandmf-minsep: BandMF with b-min-sep Poisson sampling (Monte Carlo "
        "with estimate-verify-release); bandmf-cyclic: BandMF with cyclic Poisson sampling over --min-sep "
        "subsets",
    )
    parser.add_argument("--delta", type=float, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--sampling-prob", type=float, help="dpsgd: q (or --batch-size with --dataset-size)")
    parser.add_argument("--batch-size", type=float, help="dpsgd: expected batch size")
    parser.add_argument("--dataset-size", type=int, help="dpsgd: records (also enables the delta warning)")
    parser.add_argument("--max-contributions", "-k", type=int, default=1, help="dpsgd: records per user k")
    parser.add_argument("--user-sampling-prob", type=float, help="dpsgd-uls: q_user (or --cohort-size)")
    parser.add_argument("--cohort-size", type=float, help="dpsgd-uls: expected users per step")
    parser.add_argument("--num-users", type=int, help="dpsgd-uls: users (also enables the delta warning)")
    _add_strategy(parser)
    parser.add_argument("--min-sep", type=int, help="bandmf: b, steps between a user's participations (>= bands)")
    parser.add_argument("--max-participations", type=int, help="bandmf: k, participations per user")
    parser.add_argument(
        "--records-per-step", type=int, default=1, help="bandmf: records of one user in one step at most (default 1)"
    )
    parser.add_argument(
        "--samples",
        type=int,
        help="bandmf-minsep: most Monte Carlo samples one verification may "
        "draw per direction (default: 4x what the sequential test needs "
        "at delta 0; it stops as soon as it decides)",
    )
    parser.add_argument("--seed", type=int, default=0, help="bandmf-minsep: seed of the Monte Carlo samples")
    parser.add_argument("--workers", type=int, default=1, help="bandmf-minsep: worker processes (--runner local)")
    parser.add_argument(
        "--runner",
        default=LOCAL,
        help="bandmf-minsep: 'local' (default; --workers processes) or a Beam runner that computes "
        "the Monte Carlo chunks (DirectRunner, DataflowRunner, FlinkRunner, SparkRunner); "
        "unknown options go to Beam",
    )


def _add_strategy(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bands", type=int, help="bandmf: bands of the strategy matrix C")
    parser.add_argument(
        "--strategy",
        choices=("sqrt", "optimized"),
        default="sqrt",
        help="bandmf: banded square root (default) or MSE-optimized banded Toeplitz C",
    )


class Parser(argparse.ArgumentParser):
    """madp's command line; `commands` maps a name to its subcommand's parser (`madp run` maps config keys
    to their options)."""

    commands: Mapping[str, argparse.ArgumentParser]


def _parser() -> Parser:
    parser = Parser(prog="madp", description=__doc__)
    parser.add_argument("-q", "--quiet", action="store_true", help="print only results and errors")
    commands = parser.add_subparsers(dest="command", required=True)
    parser.commands = commands.choices

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
    generate.add_argument("--seed", type=int, default=0)
    generate.add_argument(
        "--holdout",
        help="also write a held-out test set (same task, records not in OUTPUT) to this .parquet or .jsonl file",
    )
    generate.add_argument(
        "--holdout-fraction", type=float, default=0.1, help="fraction of the generated records held out (default 0.1)"
    )

    bound = commands.add_parser(
        "bound",
        allow_abbrev=False,
        help="select records so that no user exceeds its contribution bound",
        description="Round-based unanimous-proposal contribution bounding. Arguments this command does not "
        "know are passed to Apache Beam as pipeline options (e.g. --project, --region, "
        "--temp_location, --flink_master, --setup_file).",
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
    bound.add_argument("--seed", type=int, default=0, help="seed of the hash that breaks ties in the order")
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
    bound.add_argument("--output-shards", type=int, default=1, help="Parquet files in OUTPUT/selected/")
    bound.add_argument(
        "--runner",
        default="DirectRunner",
        help="'local' (in-process) or a Beam runner: DirectRunner (default), DataflowRunner, "
        "FlinkRunner, SparkRunner, ...",
    )
    bound.add_argument(
        "--partitions",
        type=int,
        default=None,
        help="Beam only: record and user partitions (default 4; use ~2-4 per worker core)",
    )
    bound.add_argument(
        "--rounds-per-pipeline",
        type=int,
        default=None,
        help="Beam only: rounds unrolled in one pipeline run (default 6)",
    )
    _add_columns(bound)

    calibrate = commands.add_parser("calibrate", help="the noise multiplier sigma for a target (epsilon, delta)")
    _add_mechanism(calibrate)
    calibrate.add_argument("--epsilon", type=float, required=True)
    calibrate.add_argument("--tolerance", type=float, default=1e-3, help="relative precision of sigma (default 1e-3)")
    inverse = commands.add_parser("epsilon", help="epsilon of a mechanism at a given noise multiplier")
    _add_mechanism(inverse)
    inverse.add_argument("--noise-multiplier", type=float, required=True)
    strategy = commands.add_parser("strategy", help="BandMF strategy coefficients and their prefix-sum MSE")
    strategy.add_argument("--steps", type=int, required=True)
    _add_strategy(strategy)

    batch = commands.add_parser(
        "batch",
        help="materialize training batches as TFRecords (b-min-sep Poisson sampling or min-sep greedy)",
        description="Unknown options are passed to Beam (e.g. --direct_num_workers 4, --project ...).",
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
        type=int,
        help="TESTING ONLY: reproduce the sampling from this seed; the batches are then not private "
        "(default: a fresh secret key per run, never written)",
    )
    batch.add_argument("--content-columns", help="comma-separated columns to carry (default: all but id and users)")
    batch.add_argument(
        "--on-invalid",
        choices=("error", "skip"),
        default="error",
        help="invalid DATA rows: stop (default) or skip them into OUTPUT/rejected/",
    )
    batch.add_argument("--output-shards", type=int, default=1, help="TFRecord files (contiguous step ranges)")
    batch.add_argument("--runner", default="DirectRunner", help="'local' (in-process) or a Beam runner name")
    batch.add_argument("--partitions", type=int, default=None, help="Beam: record and user partitions (default 4)")
    _add_columns(batch)

    verify_batches = commands.add_parser("verify-batches", help="independently check batches against the records")
    verify_batches.add_argument("output", help="a `madp batch` output directory")
    verify_batches.add_argument("data", help="the records the batches were made from")
    verify_batches.add_argument("--min-sep", type=int, required=True)
    verify_batches.add_argument("--max-participations", type=int, help="k: steps per user at most")
    verify_batches.add_argument("--max-batch-size", type=int, help="B_max: rows per step at most")
    _add_columns(verify_batches)

    training = commands.add_parser("train", help="DP-SGD or DP-BandMF training on `madp batch` outputs")
    training.add_argument("batches", help="a `madp batch` output directory")
    training.add_argument("output", help="output directory: model.keras, metrics.json, privacy.json, logs/")
    training.add_argument("--epsilon", type=float, help="target epsilon: sigma is calibrated to it")
    training.add_argument("--delta", type=float, default=1e-5)
    training.add_argument("--noise-multiplier", type=float, help="use this sigma instead (prints its epsilon)")
    training.add_argument(
        "--calibration",
        help="a privacy plan (privacy.json of a run, or the calibrate stage of "
        "`madp run`) for these batches: its sigma and guarantee are used",
    )
    training.add_argument(
        "--mechanism",
        choices=("auto", "dpsgd", "bandmf", "none"),
        default="auto",
        help="auto: DP-SGD for Poisson batches with --min-sep 1 and one band, else BandMF; "
        "none: the non-private baseline",
    )
    training.add_argument("--bands", type=int, default=1, help="BandMF bands of C (1: DP-SGD noise)")
    training.add_argument("--strategy", choices=("sqrt", "optimized"), default="sqrt", help="BandMF coefficients")
    training.add_argument(
        "--model",
        default="logreg",
        help="logreg, mlp, text-classifier, text-lm, or module:function returning (model, loss)",
    )
    training.add_argument("--features", default="features", help="feature holding the input of a numeric model")
    training.add_argument("--label", "--label-column", dest="label", default="label", help="feature holding the label")
    text = training.add_argument_group("text models (text-classifier, text-lm)")
    text.add_argument("--text-column", default="text", help="feature holding the text (default text)")
    text.add_argument(
        "--labels",
        type=lambda value: tuple(value.split(",")),
        help="text-classifier: the public label set, A,B,... (default: read from the data, which discloses it)",
    )
    text.add_argument(
        "--max-length", type=int, default=128, help="word n-grams (classifier) or bytes (language model) per text"
    )
    text.add_argument("--buckets", type=int, default=16384, help="text-classifier: hash buckets of the n-grams")
    text.add_argument("--width", type=int, help="embedding width (default 32 classifier, 64 language model)")
    text.add_argument("--layers", type=int, default=2, help="text-lm: Transformer blocks")
    text.add_argument("--heads", type=int, default=4, help="text-lm: attention heads")
    text.add_argument(
        "--on-invalid",
        choices=("error", "skip"),
        default="error",
        help="rows a text model cannot use (not UTF-8, no words, label not in --labels): stop, or train "
        "them with weight 0 and list them in OUTPUT/rejected/",
    )
    training.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    training.add_argument("--learning-rate", type=float, default=0.5)
    training.add_argument("--clip-norm", type=float, default=1.0)
    training.add_argument("--seed", type=int, default=0, help="seed of the model initialization (not of the noise)")
    training.add_argument(
        "--noise-seed",
        type=int,
        help="TESTING ONLY: reproduce the noise from this seed; the model is then not private "
        "(default: a fresh secret key per run, never written)",
    )
    training.add_argument(
        "--mc-seed", type=int, default=0, help="--amplified: seed of the Monte Carlo verification samples (public)"
    )
    training.add_argument("--eval-data", help="records (.jsonl/.parquet) to evaluate on")
    training.add_argument("--eval-every", type=int, default=100, help="steps between evaluations")
    training.add_argument(
        "--amplified",
        action="store_true",
        help="account b-min-sep Poisson batches with amplification (bandmf-minsep, Monte Carlo "
        "estimate-verify-release; falls back to unamplified BandMF when verification fails)",
    )
    training.add_argument(
        "--mc-samples",
        type=int,
        help="--amplified: most Monte Carlo samples one verification "
        "may draw per direction (default: 4x what the sequential "
        "test needs at delta 0)",
    )
    training.add_argument("--mc-workers", type=int, default=1, help="--amplified: worker processes")
    training.add_argument(
        "--distribution",
        choices=("default", "mirrored", "tpu"),
        default="default",
        help="tf.distribute strategy: default (one device), mirrored (all local GPUs, or "
        "the logical CPUs of --cpu-replicas), tpu",
    )
    training.add_argument(
        "--tpu", default="", help="--distribution tpu: TPU name or grpc:// address ('' = local TPU VM)"
    )
    training.add_argument(
        "--cpu-replicas",
        type=int,
        default=1,
        help="--distribution mirrored without GPUs: split the CPU into this many logical devices",
    )
    training.add_argument(
        "--max-contributions",
        "-k",
        type=int,
        help="K (default: read from the bounding report of the batches' SELECTED)",
    )
    training.add_argument(
        "--zero-out",
        help="a JSON list of record ids whose rows train with weight 0 (zero "
        "gradient): the zero-out neighbour of their users (madp audit)",
    )
    training.add_argument(
        "--testing-only-noise-scale",
        type=float,
        default=1.0,
        help="TESTING ONLY: multiply the noise by this while keeping the claimed guarantee "
        "(shows that madp audit catches a broken mechanism); the model is not private",
    )

    sweep = commands.add_parser(
        "recommend-k", help="sweep the contribution bound k: records kept vs noise, and a recommended k"
    )
    sweep.add_argument("input", help="a .jsonl/.parquet file or a directory of them")
    sweep.add_argument("--epsilon", type=float, required=True)
    sweep.add_argument("--delta", type=float, required=True)
    sweep.add_argument("--steps", type=int, required=True, help="T: training steps")
    sweep.add_argument("--batch-size", type=float, required=True, help="B: expected records per step")
    sweep.add_argument(
        "--mechanism",
        choices=("dpsgd", "bandmf"),
        default="dpsgd",
        help="dpsgd: Poisson batches, k records per user (default); bandmf: b-min-sep Poisson "
        "batches, unamplified, k records per step",
    )
    sweep.add_argument("--min-sep", type=int, default=1, help="bandmf: b")
    sweep.add_argument("--bands", type=int, default=1, help="bandmf: bands of C")
    sweep.add_argument("--strategy", choices=("sqrt", "optimized"), default="sqrt")
    sweep.add_argument("--clip-norm", type=float, default=1.0)
    sweep.add_argument(
        "--k",
        default=",".join(map(str, (1, 2, 3, 4, 6, 8, 12, 16))),
        help="bounds to try, comma-separated (default 1,2,3,4,6,8,12,16)",
    )
    sweep.add_argument("--order", choices=("arity", "hash"), default="arity")
    sweep.add_argument("--seed", type=int, default=0)
    _add_columns(sweep)

    mbox = commands.add_parser("import-mbox", help="email (an mbox file) as multi-user records: sender, To and Cc")
    mbox.add_argument("mbox", help="an mbox file")
    mbox.add_argument("output", help="directory: records/ (Parquet), rejected.jsonl, report.json")

    page = commands.add_parser("report", help="an HTML page with plots of a `madp run` directory's reports")
    page.add_argument("run_dir", help="the run_dir of a `madp run`")
    page.add_argument("--output", help="HTML file (default RUN_DIR/report.html)")
    page.add_argument(
        "--internal",
        action="store_true",
        help="also plot the realized sampling (batch sizes, gaps) where the guarantee relies on its "
        "secrecy; the page is then internal, not for publication",
    )

    job = commands.add_parser(
        "run",
        help="the production job from a YAML config: generate, bound, batch, "
        "calibrate, train (each optional, each resumable)",
    )
    job.add_argument("config", help="YAML config (see examples/demo.yaml)")
    job.add_argument("--force", action="store_true", help="re-run every stage, even those up to date")
    job.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a config value (repeatable), e.g. --set bound.max_contributions=4",
    )

    audit = commands.add_parser(
        "audit",
        help="an empirical lower bound on the epsilon of the model a config "
        "trains: plant canary users, train once, guess who was included",
    )
    audit.add_argument("config", help="the YAML config of `madp run`; its audit section gives the defaults below")
    audit.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config value (repeatable)"
    )
    audit.add_argument("--canaries", type=int, help="m: canary users (default 1000)")
    audit.add_argument("--confidence", type=float, help="of the lower bound (default 0.95)")
    audit.add_argument(
        "--canary-norm", type=float, help="canary feature norm, in real records' median norms (default 10)"
    )
    audit.add_argument("--shared", type=float, help="fraction of canaries sharing a record with another (default 0.5)")
    audit.add_argument("--output", help="directory of the audit's data, model and audit.json (default RUN_DIR/audit)")
    audit.add_argument(
        "--non-private",
        action="store_true",
        default=None,
        help="train the audit model without privacy: what the audit can see when nothing protects",
    )
    audit.add_argument(
        "--testing-only-noise-scale",
        type=float,
        help="TESTING ONLY: scale the audit model's noise while keeping the claim; the audit must fail",
    )
    audit.add_argument("--seed", type=int, help="TESTING ONLY: reproduce canaries and inclusion (default: secret)")
    audit.add_argument("--force", action="store_true", help="re-run every stage of the audit's job")

    verify = commands.add_parser("verify-bound", help="independently check a bounding output against its input")
    verify.add_argument("input")
    verify.add_argument("output", help="a `madp bound` output directory")
    verify.add_argument("--max-contributions", "-k", type=int, required=True)
    verify.add_argument("--capacities")
    _add_columns(verify)
    return parser


def _graph_spec(args: argparse.Namespace):
    from madp.synthetic import GraphSpec

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


def _generate(args: argparse.Namespace) -> dict:
    from madp.synthetic import generate, write_dataset

    spec = _graph_spec(args)
    return write_dataset(generate(spec), spec, args.output, args.shards, args.holdout, args.holdout_fraction)


def _bound_options(args: argparse.Namespace):
    from madp.selection import BoundOptions

    return BoundOptions(
        max_contributions=args.max_contributions,
        order=args.order,
        seed=args.seed,
        max_rounds=args.max_rounds,
        duplicates=args.duplicates,
        columns=Columns(args.id_column, args.users_column, args.weight_column),
        on_invalid=args.on_invalid,
        capacities=args.capacities,
        output_shards=args.output_shards,
        arity_threshold=args.arity_threshold,
        small_run=args.small_run,
        large_run=args.large_run,
    )


def _local_takes_no_beam_options(args: argparse.Namespace, beam_args: list[str], *beam_only: str) -> None:
    """--runner local runs in this process: a Beam option, or one of madp's Beam-only options (the
    attributes `beam_only` of `args`), is a mistake to report, not to drop."""
    given = [*beam_args, *(f"--{name.replace('_', '-')}" for name in beam_only if getattr(args, name))]
    if args.runner == LOCAL and given:
        raise InputError(f"--runner local takes no Beam options (got {' '.join(given)})")


def _bound(args: argparse.Namespace, beam_args: list[str]) -> dict:
    options = _bound_options(args)
    _local_takes_no_beam_options(args, beam_args, "partitions", "rounds_per_pipeline")
    if args.runner == LOCAL:
        from madp.local_engine import run_local

        return run_local(args.input, args.output, options)
    from beam_pipelines.bound import DEFAULT_PARTITIONS, DEFAULT_ROUNDS_PER_PIPELINE, run_beam

    return run_beam(
        args.input,
        args.output,
        options,
        ["--runner", args.runner, *beam_args],
        partitions=args.partitions or DEFAULT_PARTITIONS,
        rounds_per_pipeline=args.rounds_per_pipeline or DEFAULT_ROUNDS_PER_PIPELINE,
    )


def _batch_options(args: argparse.Namespace):
    from madp.batching import BatchOptions

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
        columns=Columns(args.id_column, args.users_column),
        content_columns=content,
        on_invalid=args.on_invalid,
        output_shards=args.output_shards,
    )


def _batch(args: argparse.Namespace, beam_args: list[str]) -> dict:
    options = _batch_options(args)
    _local_takes_no_beam_options(args, beam_args, "partitions")
    if args.runner == LOCAL:
        from madp.batching import run_local

        return run_local(args.selected, args.data, args.output, options)
    from beam_pipelines.batch import DEFAULT_PARTITIONS, run_beam

    return run_beam(
        args.selected,
        args.data,
        args.output,
        options,
        ["--runner", args.runner, *beam_args],
        partitions=args.partitions or DEFAULT_PARTITIONS,
    )


def _train_options(args: argparse.Namespace):
    from tf_training.plan import TrainOptions

    return TrainOptions(
        epsilon=args.epsilon,
        delta=args.delta,
        noise_multiplier=args.noise_multiplier,
        mechanism=args.mechanism,
        bands=args.bands,
        strategy=args.strategy,
        model=args.model,
        features=args.features,
        label=args.label,
        optimizer=args.optimizer,
        learning_rate=args.learning_rate,
        clip_norm=args.clip_norm,
        seed=args.seed,
        noise_seed=args.noise_seed,
        mc_seed=args.mc_seed,
        eval_data=args.eval_data,
        eval_every=args.eval_every,
        max_contributions=args.max_contributions,
        amplified=args.amplified,
        mc_samples=args.mc_samples,
        mc_workers=args.mc_workers,
        distribution=args.distribution,
        tpu=args.tpu,
        cpu_replicas=args.cpu_replicas,
        calibration=args.calibration,
        zero_out=args.zero_out,
        testing_noise_scale=args.testing_only_noise_scale,
        text_column=args.text_column,
        labels=args.labels,
        max_length=args.max_length,
        buckets=args.buckets,
        width=args.width,
        layers=args.layers,
        heads=args.heads,
        on_invalid=args.on_invalid,
    )


def _train(args: argparse.Namespace) -> dict:
    from tf_training.trainer import train

    result = train(args.batches, args.output, _train_options(args))
    result["privacy"] = {k: v for k, v in result["privacy"].items() if k != "batch_files_sha256"}
    return result


def _require(args: argparse.Namespace, mechanism: str, *options: str) -> None:
    if any(getattr(args, option.lstrip("-").replace("-", "_")) is None for option in options):
        raise InputError(f"{mechanism} needs {', '.join(options[:-1])} and {options[-1]}")


def _bands(args: argparse.Namespace) -> tuple[float, ...]:
    from accounting.strategies import coefficients

    if args.bands is None:
        raise InputError("--bands is required")
    return tuple(coefficients(args.strategy, args.steps, args.bands).tolist())


def _strategy(args: argparse.Namespace) -> dict:
    import numpy as np

    from accounting.strategies import prefix_sum_mse, sqrt_coefficients

    bands = np.array(_bands(args))
    return {
        "steps": args.steps,
        "bands": args.bands,
        "strategy": args.strategy,
        "coefficients": bands.tolist(),
        "prefix_sum_mse": prefix_sum_mse(bands, args.steps),
        "sqrt_prefix_sum_mse": prefix_sum_mse(sqrt_coefficients(args.bands), args.steps),
    }


def _mechanism(args: argparse.Namespace):
    from accounting.mechanisms import BandMf, BandMfCyclic, DpSgd, DpSgdUls, Mechanism

    if args.mechanism == "bandmf-cyclic":
        _require(args, "bandmf-cyclic", "--sampling-prob", "--bands", "--min-sep")
        return BandMfCyclic(args.sampling_prob, args.steps, args.min_sep, _bands(args))
    if args.mechanism == "bandmf":
        _require(args, "bandmf", "--bands", "--min-sep", "--max-participations")
        return BandMf(args.steps, args.min_sep, args.max_participations, _bands(args), args.records_per_step)
    mechanism: Mechanism
    if args.mechanism == "dpsgd":
        population = args.dataset_size
        mechanism = DpSgd(
            _probability(
                args,
                args.sampling_prob,
                args.batch_size,
                population,
                ("--sampling-prob", "--batch-size", "--dataset-size"),
            ),
            args.steps,
            args.max_contributions,
        )
    else:
        population = args.num_users
        mechanism = DpSgdUls(
            _probability(
                args,
                args.user_sampling_prob,
                args.cohort_size,
                population,
                ("--user-sampling-prob", "--cohort-size", "--num-users"),
            ),
            args.steps,
        )
    if population and args.delta > 1 / population:
        log.warning(
            "delta %g exceeds 1/%d: a mechanism could release one record or user in the clear", args.delta, population
        )
    return mechanism


def _probability(
    args: argparse.Namespace,
    probability: float | None,
    expected: float | None,
    population: int | None,
    names: tuple[str, str, str],
) -> float:
    """A sampling probability given directly, or as an expected count out of a population."""
    from accounting.mechanisms import sampling_probability

    if probability is not None:
        return probability
    if expected is None or population is None:
        raise InputError(f"{args.mechanism} needs {names[0]}, or {names[1]} with {names[2]}")
    return sampling_probability(expected, population)


def _minsep(args: argparse.Namespace, beam_args: list[str]) -> dict:
    """BandMF with b-min-sep Poisson sampling: Algorithm 5, unamplified BandMF as the fallback."""
    import time

    from accounting.evr import calibrate_minsep, epsilon_minsep
    from accounting.monte_carlo import MinSepProcess

    _require(args, "bandmf-minsep", "--sampling-prob", "--bands", "--min-sep")
    started = time.perf_counter()
    bands = _bands(args)
    process = MinSepProcess(args.steps, args.min_sep, args.sampling_prob, args.max_contributions, bands)
    k_u = args.max_contributions
    _local_takes_no_beam_options(args, beam_args)
    runner_args = None if args.runner == LOCAL else ["--runner", args.runner, *beam_args]
    if args.command == "calibrate":
        result = calibrate_minsep(process, args.epsilon, args.delta, args.samples, args.seed, args.workers, runner_args)
        named = {
            "noise_multiplier": result.value,
            "fallback_noise_multiplier": result.fallback,
            "estimated_noise_multiplier": result.estimate,
            "epsilon": args.epsilon,
            "target_epsilon": args.epsilon,
        }
    else:
        result = epsilon_minsep(
            process, args.noise_multiplier, args.delta, args.samples, args.seed, args.workers, runner_args
        )
        named = {
            "noise_multiplier": args.noise_multiplier,
            "epsilon": result.value,
            "fallback_epsilon": result.fallback,
            "estimated_epsilon": result.estimate,
        }
    return {
        "mechanism": "bandmf-minsep",
        "steps": args.steps,
        "sampling_prob": args.sampling_prob,
        "min_sep": args.min_sep,
        "bands": args.bands,
        "strategy": args.strategy,
        "coefficients": list(bands),
        "max_contributions": k_u,
        **named,
        **result.report(sigma_fixed=args.command == "epsilon"),
        "target_delta": args.delta,
        "seed": args.seed,
        "workers": args.workers,
        "runner": args.runner,
        "accountant": "Monte Carlo with estimate-verify-release (b-min-sep paper, App. A)",
        "wall_time_s": round(time.perf_counter() - started, 3),
    }


def _accounting(args: argparse.Namespace, beam_args: list[str]) -> dict:
    import dataclasses

    from accounting.calibrate import calibrate, epsilon

    if args.mechanism == "bandmf-minsep":
        return _minsep(args, beam_args)
    if args.runner != LOCAL or beam_args:
        raise InputError(f"--runner and Beam options apply to bandmf-minsep only (got {args.runner} {beam_args})")
    mechanism = _mechanism(args)
    result = {
        "mechanism": mechanism.name,
        **dataclasses.asdict(mechanism),
        "delta": args.delta,
        "strategy": args.strategy if args.mechanism.startswith("bandmf") else None,
        "dataset_size": args.dataset_size,
        "num_users": args.num_users,
        "batch_size": args.batch_size,
        "cohort_size": args.cohort_size,
    }
    if args.command == "epsilon":
        return {
            **result,
            "noise_multiplier": args.noise_multiplier,
            "epsilon": epsilon(mechanism, args.noise_multiplier, args.delta),
        }
    calibration = calibrate(mechanism, args.epsilon, args.delta, args.tolerance)
    return {
        **result,
        "noise_multiplier": calibration.noise_multiplier,
        "epsilon": calibration.epsilon,
        "target_epsilon": args.epsilon,
        "relative_tolerance": args.tolerance,
        "accountant": "PLD (dp_accounting), pessimistic discretization",
    }


def _verify(args: argparse.Namespace) -> dict:
    from madp.verify import verify_bound

    return verify_bound(
        args.input, args.output, args.max_contributions, args.capacities, args.id_column, args.users_column
    )


def stage_options(args: argparse.Namespace) -> None:
    """Build (and so validate) the options of a parsed command without running it."""
    builders = {"generate": _graph_spec, "bound": _bound_options, "batch": _batch_options, "train": _train_options}
    if args.command in builders:
        builders[args.command](args)


def calibrate_batches(args: argparse.Namespace) -> dict:
    """The privacy plan of training on args.batches with args' privacy options, written to args.output."""
    from madp import storage
    from tf_training.batches import open_batches
    from tf_training.plan import epsilon_curve, privacy_plan

    plan = privacy_plan(open_batches(args.batches), _train_options(args))
    plan["epsilon_curve"] = epsilon_curve(plan)
    storage.write_text(args.output, json.dumps(plan, indent=2))
    return plan


def run_stage(args: argparse.Namespace, unknown: list[str]) -> dict:
    """Run one parsed `madp` command; its result as printed."""
    if args.command == "generate":
        return _generate(args)
    if args.command == "bound":
        result = _bound(args, unknown)
        return {k: v for k, v in result.items() if k != "per_round"}
    if args.command == "batch":
        result = _batch(args, unknown)
        result["batch_sizes"] = {k: v for k, v in result["batch_sizes"].items() if k != "per_step"}
        return result
    if args.command == "verify-batches":
        from madp.verify import verify_batches

        return verify_batches(
            args.output,
            args.data,
            args.min_sep,
            args.max_participations,
            args.max_batch_size,
            args.id_column,
            args.users_column,
        )
    if args.command == "train":
        return _train(args)
    if args.command in ("calibrate", "epsilon"):
        return _accounting(args, unknown)
    if args.command == "strategy":
        return _strategy(args)
    if args.command == "report":
        from madp.report import write_report

        return write_report(args.run_dir, args.output, args.internal)
    if args.command == "import-mbox":
        from madp.mbox import import_mbox

        return import_mbox(args.mbox, args.output)
    if args.command == "recommend-k":
        from madp.recommend import Sweep, recommend

        try:
            ks = tuple(int(k) for k in args.k.split(",") if k.strip())
        except ValueError:
            raise InputError(f"--k must list integers, got {args.k!r}") from None
        return recommend(
            args.input,
            Sweep(
                args.epsilon,
                args.delta,
                args.steps,
                args.batch_size,
                args.mechanism,
                args.min_sep,
                args.bands,
                args.strategy,
                args.clip_norm,
                ks,
                args.order,
                args.seed,
                Columns(args.id_column, args.users_column),
            ),
        )
    if args.command == "run":
        from madp.run import run

        return run(args.config, args.set, args.force)
    if args.command == "audit":
        from madp.audit import run_audit

        flags = {
            "canaries": args.canaries,
            "confidence": args.confidence,
            "canary_norm": args.canary_norm,
            "shared": args.shared,
            "output": args.output,
            "non_private": args.non_private,
            "testing_noise_scale": args.testing_only_noise_scale,
            "seed": args.seed,
        }
        return run_audit(args.config, args.set, flags, args.force)
    return _verify(args)


def _written_directory(args: argparse.Namespace) -> str | None:
    """The output directory a command writes (held exclusively while it runs); `madp run` holds its run_dir."""
    if args.command in ("bound", "batch", "train", "import-mbox"):
        return args.output
    if args.command == "generate" and not args.output.endswith((".jsonl", ".parquet")):
        return args.output
    return None


def main(argv: list[str] | None = None) -> int:
    args, unknown = _parser().parse_known_args(argv)
    if unknown and args.command not in ("bound", "batch", "calibrate", "epsilon"):
        _parser().error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO,
        format="%(asctime)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    # Beam relays its workers' start-up warnings (missing GCP client libraries, unparsed
    # options) through these loggers; they say nothing about the job.
    logging.getLogger("apache_beam").setLevel(logging.ERROR)
    # The DirectRunner also relays worker tracebacks; the driver raises the same failure itself.
    logging.getLogger("apache_beam.runners.portability.local_job_service").setLevel(logging.CRITICAL)
    logging.getLogger().addFilter(lambda record: "apitools not found" not in record.getMessage())
    output = _written_directory(args)
    try:
        with storage.exclusive(output, args.command) if output else contextlib.nullcontext():
            result = run_stage(args, unknown)
    except CheckFailed as error:
        print(json.dumps(error.result, indent=2, sort_keys=True, default=str))
        print(f"madp {args.command}: FAILED: {error}", file=sys.stderr)
        return 1
    except InputError as error:
        print(f"madp {args.command}: error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2, sort_keys=True))
    return 1 if result.get("ok") is False else 0


if __name__ == "__main__":
    sys.exit(main())
