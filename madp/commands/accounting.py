"""Accounting: `madp calibrate`, `madp epsilon`, `madp strategy` and `madp recommend-k`."""

from __future__ import annotations

import argparse
import functools
import logging

from madp.commands.registry import Family, add_options, options_from
from madp.core.errors import InputError
from madp.core.options import seed_argument
from madp.core.records import ColumnOptions
from madp.stages.arguments import LOCAL, refuse_beam_options_locally

log = logging.getLogger("madp")

CUDA = "cuda"  # --runner: the Monte Carlo samples on one NVIDIA GPU


def add_parsers(commands: argparse._SubParsersAction) -> None:
    calibrate = commands.add_parser("calibrate", help="the noise multiplier sigma for a target (epsilon, delta)")
    add_mechanism(calibrate)
    calibrate.add_argument("--epsilon", type=float, required=True)
    calibrate.add_argument("--tolerance", type=float, default=1e-3, help="relative precision of sigma (default 1e-3)")
    inverse = commands.add_parser("epsilon", help="epsilon of a mechanism at a given noise multiplier")
    add_mechanism(inverse)
    inverse.add_argument("--noise-multiplier", type=float, required=True)
    strategy = commands.add_parser("strategy", help="BandMF strategy coefficients and their prefix-sum MSE")
    strategy.add_argument("--steps", type=int, required=True)
    add_strategy(strategy)

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
    sweep.add_argument("--seed", type=seed_argument, default=0)
    sweep.add_argument(
        "--truncation-share",
        type=float,
        default=0.1,
        help="dpsgd: the share of delta truncation to --max-batch-size may take; each k's B_max is the "
        "smallest within it (default 0.1; calibration refuses 0.5 or more)",
    )
    sweep.add_argument(
        "--write-config",
        metavar="JOB.yaml",
        help="write a `madp run` config for the recommended k (input, bound, batch, calibrate, train)",
    )
    sweep.add_argument("--run-dir", help="the written config's run_dir (default: JOB-output beside JOB.yaml)")
    sweep.add_argument(
        "--model",
        help="the written config's train.model (default: logreg on features/label; on a text or body "
        "column text-classifier with --labels, else text-lm)",
    )
    sweep.add_argument(
        "--labels",
        type=lambda value: tuple(label for label in value.split(",") if label),
        help="the public label set A,B,... of a text-classifier config (train.labels)",
    )
    sweep.add_argument(
        "--label-column", default="label", help="the written config's label column (train.label; default label)"
    )
    sweep.add_argument(
        "--text-column", help="the written config's text column (train.text_column; default text, else body)"
    )
    add_options(sweep, ColumnOptions)


def add_mechanism(parser: argparse.ArgumentParser) -> None:
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
    add_strategy(parser)
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
    parser.add_argument("--seed", type=seed_argument, default=0, help="bandmf-minsep: seed of the Monte Carlo samples")
    parser.add_argument("--workers", type=int, default=1, help="bandmf-minsep: worker processes (--runner local)")
    parser.add_argument(
        "--runner",
        default=LOCAL,
        help="bandmf-minsep: 'local' (default; --workers processes), 'cuda' (one NVIDIA GPU draws the "
        "samples: pip install 'madp[cuda]') or a Beam runner that computes the Monte Carlo chunks "
        "(DirectRunner, DataflowRunner, FlinkRunner, SparkRunner); unknown options go to Beam",
    )


def add_strategy(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bands", type=int, help="bandmf: bands of the strategy matrix C")
    parser.add_argument(
        "--strategy",
        choices=("sqrt", "optimized"),
        default="sqrt",
        help="bandmf: banded square root (default) or MSE-optimized banded Toeplitz C",
    )


def _require(args: argparse.Namespace, mechanism: str, *options: str) -> None:
    if any(getattr(args, option.lstrip("-").replace("-", "_")) is None for option in options):
        raise InputError(f"{mechanism} needs {', '.join(options[:-1])} and {options[-1]}")


def _bands(args: argparse.Namespace) -> tuple[float, ...]:
    from madp.accounting.strategies import coefficients

    if args.bands is None:
        raise InputError("--bands is required")
    return tuple(coefficients(args.strategy, args.steps, args.bands).tolist())


def _strategy(args: argparse.Namespace, unknown: list[str]) -> dict:
    import numpy as np

    from madp.accounting.strategies import prefix_sum_mse, sqrt_coefficients

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
    from madp.accounting.mechanisms import BandMf, BandMfCyclic, DpSgd, DpSgdUls, Mechanism

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
    from madp.accounting.mechanisms import sampling_probability

    if probability is not None:
        return probability
    if expected is None or population is None:
        raise InputError(f"{args.mechanism} needs {names[0]}, or {names[1]} with {names[2]}")
    return sampling_probability(expected, population)


def _minsep(args: argparse.Namespace, beam_args: list[str]) -> dict:
    """BandMF with b-min-sep Poisson sampling: Algorithm 5, unamplified BandMF as the fallback."""
    import time

    from madp.accounting.evr import calibrate_minsep, epsilon_minsep
    from madp.accounting.mc_delta import RemoteMap
    from madp.accounting.monte_carlo import MinSepProcess

    _require(args, "bandmf-minsep", "--sampling-prob", "--bands", "--min-sep")
    started = time.perf_counter()
    bands = _bands(args)
    process = MinSepProcess(args.steps, args.min_sep, args.sampling_prob, args.max_contributions, bands)
    k_u = args.max_contributions
    refuse_beam_options_locally(args.runner, beam_args)
    remote: RemoteMap | None = None
    if args.runner == CUDA:
        if beam_args:
            raise InputError(f"--runner cuda takes no Beam options (got {' '.join(beam_args)})")
        if args.workers != 1:
            raise InputError("--workers is for --runner local: --runner cuda draws every sample on one GPU")
        from madp.accounting.monte_carlo_cuda import gpu_task_map

        remote = gpu_task_map()
    elif args.runner != LOCAL:
        from madp.beam.monte_carlo import BeamTaskMap

        remote = functools.partial(BeamTaskMap, ["--runner", args.runner, *beam_args])
    if args.command == "calibrate":
        result = calibrate_minsep(process, args.epsilon, args.delta, args.samples, args.seed, args.workers, remote)
        named = {"noise_multiplier": result.value, "epsilon": args.epsilon, "target_epsilon": args.epsilon}
    else:
        result = epsilon_minsep(
            process, args.noise_multiplier, args.delta, args.samples, args.seed, args.workers, remote
        )
        named = {"noise_multiplier": args.noise_multiplier, "epsilon": result.value}
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

    from madp.accounting.calibrate import calibrate, finite_epsilon

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
            "epsilon": finite_epsilon(mechanism, args.noise_multiplier, args.delta),
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


def _recommend(args: argparse.Namespace, unknown: list[str]) -> dict:
    """The sweep as JSON on stdout, its table on stderr; with --write-config, the job of the recommended k."""
    import sys

    from madp.core.reports import VERSION_KEY
    from madp.stages.recommending import job_config_of, run_recommend_k
    from madp.tools.planning.recommend import Sweep, table

    try:
        ks = tuple(int(k) for k in args.k.split(",") if k.strip())
    except ValueError:
        raise InputError(f"--k must list integers, got {args.k!r}") from None
    sweep = Sweep(
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
        options_from(ColumnOptions, args).columns,
        args.truncation_share,
    )
    config = job_config_of(
        args.write_config, args.run_dir, args.model, args.labels, args.label_column, args.text_column
    )
    result = run_recommend_k(args.input, sweep, config, show=lambda result: print(table(result), file=sys.stderr))
    return {key: value for key, value in result.to_json().items() if key != VERSION_KEY}  # the file's, not printed


FAMILY = Family(
    add_parsers,
    {"calibrate": _accounting, "epsilon": _accounting, "strategy": _strategy, "recommend-k": _recommend},
    beam_options=frozenset({"calibrate", "epsilon"}),
)
