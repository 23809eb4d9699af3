"""Accounting: `madp calibrate`, `madp epsilon`, `madp strategy` and `madp recommend-k`."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
from typing import Any

from madp.commands.registry import Family
from madp.core.errors import OptionError
from madp.core.options import add_options, check_choices, comma_names, option, options_from, seed_argument
from madp.core.records import ColumnOptions
from madp.stages.arguments import LOCAL, refuse_runner_options_locally
from madp.training.options import STRATEGIES, clip_norm_option

log = logging.getLogger("madp")

CUDA = "cuda"  # --runner: the Monte Carlo samples on one NVIDIA GPU
MECHANISMS = ("dpsgd", "dpsgd-uls", "bandmf", "bandmf-minsep", "bandmf-cyclic")  # what calibrate and epsilon account
SWEPT_MECHANISMS = ("dpsgd", "bandmf")  # what recommend-k plans for
ORDERS = ("arity", "hash")  # recommend-k's bounding orders
SWEPT_KS = (1, 2, 3, 4, 6, 8, 12, 16)  # recommend-k's default bounds


# An option field serves one dataclass: a declaration several commands share is a function that makes it.
def _bands_option() -> Any:
    """--bands of `madp strategy`, `madp calibrate` and `madp epsilon` (none: refused where BandMF needs it)."""
    return option(None, help="bandmf: bands of the strategy matrix C")


def _strategy_option() -> Any:
    """--strategy of `madp strategy`, `madp calibrate` and `madp epsilon`."""
    return option(
        "sqrt", choices=STRATEGIES, help="bandmf: banded square root (default) or MSE-optimized banded Toeplitz C"
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class StrategyOptions:
    """The options of `madp strategy` (each field its `--flag`): the BandMF strategy of `steps` steps."""

    steps: int = option()
    bands: int | None = _bands_option()
    strategy: str = _strategy_option()

    def __post_init__(self) -> None:
        check_choices(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MechanismOptions:
    """The mechanism `madp calibrate` and `madp epsilon` account (each field its `--flag`), and where
    bandmf-minsep's Monte Carlo samples are drawn; which options a mechanism needs is checked as it is
    built from them (`_mechanism`)."""

    mechanism: str = option(
        choices=MECHANISMS,
        help="dpsgd: example-level Poisson sampling, k records per user (mixture of Gaussians); "
        "dpsgd-uls: user-level Poisson sampling; bandmf: BandMF on (k, b)-min-sep batches, "
        "unamplified; bandmf-minsep: BandMF with b-min-sep Poisson sampling (Monte Carlo "
        "with estimate-verify-release); bandmf-cyclic: BandMF with cyclic Poisson sampling over --min-sep "
        "subsets",
    )
    delta: float = option()
    steps: int = option()
    sampling_prob: float | None = option(None, help="dpsgd: q (or --batch-size with --dataset-size)")
    batch_size: float | None = option(None, help="dpsgd: expected batch size")
    dataset_size: int | None = option(None, help="dpsgd: records (also enables the delta warning)")
    max_contributions: int = option(1, aliases=("-k",), help="dpsgd: records per user k")
    user_sampling_prob: float | None = option(None, help="dpsgd-uls: q_user (or --cohort-size)")
    cohort_size: float | None = option(None, help="dpsgd-uls: expected users per step")
    num_users: int | None = option(None, help="dpsgd-uls: users (also enables the delta warning)")
    bands: int | None = _bands_option()
    strategy: str = _strategy_option()
    min_sep: int | None = option(None, help="bandmf: b, steps between a user's participations (>= bands)")
    max_participations: int | None = option(None, help="bandmf: k, participations per user")
    records_per_step: int = option(1, help="bandmf: records of one user in one step at most (default 1)")
    samples: int | None = option(  # None: `evr`'s default
        None,
        help="bandmf-minsep: most Monte Carlo samples one verification may "
        "draw per direction (default: 4x what the sequential test needs "
        "at delta 0; it stops as soon as it decides)",
    )
    seed: int = option(0, parse=seed_argument, help="bandmf-minsep: seed of the Monte Carlo samples")
    workers: int = option(1, help="bandmf-minsep: worker processes (--runner local)")
    runner: str = option(
        LOCAL,
        help="bandmf-minsep: 'local' (default; --workers processes), 'cuda' (one NVIDIA GPU draws the "
        "samples: pip install 'madp[cuda]') or a Beam runner that computes the Monte Carlo chunks "
        "(DirectRunner, DataflowRunner, FlinkRunner, SparkRunner); unknown options go to Beam",
    )

    def __post_init__(self) -> None:
        check_choices(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CalibrateOptions(MechanismOptions):
    """The options of `madp calibrate`: the mechanism, and the epsilon to find its sigma for."""

    epsilon: float = option()
    tolerance: float = option(1e-3, help="relative precision of sigma (default 1e-3)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EpsilonOptions(MechanismOptions):
    """The options of `madp epsilon`: the mechanism, and the sigma to state its epsilon at."""

    noise_multiplier: float = option()


@dataclasses.dataclass(frozen=True)
class RecommendOptions(ColumnOptions):
    """The options of `madp recommend-k` (each field its `--flag`): the training planned, the bounds swept,
    and the `madp run` config written for the recommended one; the Sweep checks them (`sweep`)."""

    epsilon: float = option()
    delta: float = option()
    steps: int = option(help="T: training steps")
    batch_size: float = option(help="B: expected records per step")
    mechanism: str = option(
        "dpsgd",
        choices=SWEPT_MECHANISMS,
        help="dpsgd: Poisson batches, k records per user (default); bandmf: b-min-sep Poisson "
        "batches, unamplified, k records per step",
    )
    min_sep: int = option(1, help="bandmf: b")
    bands: int = option(1, help="bandmf: bands of C")
    strategy: str = option("sqrt", choices=STRATEGIES)
    clip_norm: float = clip_norm_option()
    k: str = option(",".join(map(str, SWEPT_KS)), help="bounds to try, comma-separated (default 1,2,3,4,6,8,12,16)")
    order: str = option("arity", choices=ORDERS)
    seed: int = option(0, parse=seed_argument)
    truncation_share: float = option(
        0.1,
        help="dpsgd: the share of delta truncation to --max-batch-size may take; each k's B_max is the "
        "smallest within it (default 0.1; calibration refuses 0.5 or more)",
    )
    write_config: str | None = option(
        None,
        metavar="JOB.yaml",
        help="write a `madp run` config for the recommended k (input, bound, batch, calibrate, train)",
    )
    run_dir: str | None = option(None, help="the written config's run_dir (default: JOB-output beside JOB.yaml)")
    model: str | None = option(
        None,
        help="the written config's train.model (default: logreg on features/label; on a text or body "
        "column text-classifier with --labels, else text-lm)",
    )
    labels: tuple[str, ...] | None = option(
        None, parse=comma_names, help="the public label set A,B,... of a text-classifier config (train.labels)"
    )
    label_column: str = option("label", help="the written config's label column (train.label; default label)")
    text_column: str | None = option(
        None, help="the written config's text column (train.text_column; default text, else body)"
    )

    @property
    def ks(self) -> tuple[int, ...]:
        """The bounds --k lists."""
        try:
            return tuple(int(k) for k in self.k.split(",") if k.strip())
        except ValueError:
            raise OptionError("{k} must list integers, got {0!r}", self.k) from None


def add_parsers(commands: argparse._SubParsersAction) -> None:
    calibrate = commands.add_parser("calibrate", help="the noise multiplier sigma for a target (epsilon, delta)")
    add_options(calibrate, CalibrateOptions)
    inverse = commands.add_parser("epsilon", help="epsilon of a mechanism at a given noise multiplier")
    add_options(inverse, EpsilonOptions)
    strategy = commands.add_parser("strategy", help="BandMF strategy coefficients and their prefix-sum MSE")
    add_options(strategy, StrategyOptions)

    sweep = commands.add_parser(
        "recommend-k", help="sweep the contribution bound k: records kept vs noise, and a recommended k"
    )
    sweep.add_argument("input", help="a .jsonl/.parquet file or a directory of them")
    add_options(sweep, RecommendOptions)


def _missing(mechanism: str, *names: str) -> OptionError:
    """`mechanism` needs the options `names`, one of which was not given."""
    placed = [f"{{{name}}}" for name in names]
    return OptionError(f"{{0}} needs {', '.join(placed[:-1])} and {placed[-1]}", mechanism)


def _coefficients(strategy: str, steps: int, bands: int) -> tuple[float, ...]:
    from madp.accounting.strategies import coefficients

    return tuple(coefficients(strategy, steps, bands).tolist())


def _strategy(args: argparse.Namespace, unknown: list[str]) -> dict:
    import numpy as np

    from madp.accounting.strategies import prefix_sum_mse, sqrt_coefficients

    options = options_from(StrategyOptions, args)
    if options.bands is None:
        raise OptionError("{bands} is required")
    bands = np.array(_coefficients(options.strategy, options.steps, options.bands))
    return {
        "steps": options.steps,
        "bands": options.bands,
        "strategy": options.strategy,
        "coefficients": bands.tolist(),
        "prefix_sum_mse": prefix_sum_mse(bands, options.steps),
        "sqrt_prefix_sum_mse": prefix_sum_mse(sqrt_coefficients(options.bands), options.steps),
    }


def _mechanism(options: MechanismOptions):
    """The mechanism `options` describe (all but bandmf-minsep, which `_minsep` accounts), refused by name
    where an option it needs is missing."""
    from madp.accounting.mechanisms import BandMf, BandMfCyclic, DpSgd, DpSgdUls, Mechanism

    if options.mechanism == "bandmf-cyclic":
        if options.sampling_prob is None or options.bands is None or options.min_sep is None:
            raise _missing("bandmf-cyclic", "sampling_prob", "bands", "min_sep")
        coefficients = _coefficients(options.strategy, options.steps, options.bands)
        return BandMfCyclic(options.sampling_prob, options.steps, options.min_sep, coefficients)
    if options.mechanism == "bandmf":
        if options.bands is None or options.min_sep is None or options.max_participations is None:
            raise _missing("bandmf", "bands", "min_sep", "max_participations")
        coefficients = _coefficients(options.strategy, options.steps, options.bands)
        return BandMf(
            options.steps, options.min_sep, options.max_participations, coefficients, options.records_per_step
        )
    mechanism: Mechanism
    if options.mechanism == "dpsgd":
        population = options.dataset_size
        probability = _probability(
            options.mechanism,
            options.sampling_prob,
            options.batch_size,
            population,
            ("sampling_prob", "batch_size", "dataset_size"),
        )
        mechanism = DpSgd(probability, options.steps, options.max_contributions)
    else:
        population = options.num_users
        probability = _probability(
            options.mechanism,
            options.user_sampling_prob,
            options.cohort_size,
            population,
            ("user_sampling_prob", "cohort_size", "num_users"),
        )
        mechanism = DpSgdUls(probability, options.steps)
    if population and options.delta > 1 / population:
        log.warning(
            "delta %g exceeds 1/%d: a mechanism could release one record or user in the clear",
            options.delta,
            population,
        )
    return mechanism


def _probability(
    mechanism: str,
    probability: float | None,
    expected: float | None,
    population: int | None,
    names: tuple[str, str, str],
) -> float:
    """A sampling probability given directly, or as an expected count out of a population (the options
    `names`: the probability, the count, the population)."""
    from madp.accounting.mechanisms import sampling_probability

    if probability is not None:
        return probability
    if expected is None or population is None:
        given, count, out_of = names
        raise OptionError(f"{{0}} needs {{{given}}}, or {{{count}}} with {{{out_of}}}", mechanism)
    return sampling_probability(expected, population)


def _minsep(options: CalibrateOptions | EpsilonOptions, runner_options: list[str]) -> dict:
    """BandMF with b-min-sep Poisson sampling: Algorithm 5, unamplified BandMF as the fallback."""
    import time

    from madp.accounting.evr import calibrate_minsep, epsilon_minsep
    from madp.accounting.mc_delta import RemoteMap
    from madp.accounting.monte_carlo import MinSepProcess

    if options.sampling_prob is None or options.bands is None or options.min_sep is None:
        raise _missing("bandmf-minsep", "sampling_prob", "bands", "min_sep")
    started = time.perf_counter()
    bands = _coefficients(options.strategy, options.steps, options.bands)
    process = MinSepProcess(options.steps, options.min_sep, options.sampling_prob, options.max_contributions, bands)
    refuse_runner_options_locally(options.runner, runner_options)
    remote: RemoteMap | None = None
    if options.runner == CUDA:
        if runner_options:
            raise OptionError("{runner} cuda takes no runner options (got {0})", " ".join(runner_options))
        if options.workers != 1:
            raise OptionError("{workers} is for {runner} local: {runner} cuda draws every sample on one GPU")
        from madp.accounting.monte_carlo_cuda import gpu_task_map

        remote = gpu_task_map()
    elif options.runner != LOCAL:
        from madp.beam.monte_carlo import BeamTaskMap

        remote = functools.partial(BeamTaskMap, ["--runner", options.runner, *runner_options])
    if isinstance(options, CalibrateOptions):
        result = calibrate_minsep(
            process, options.epsilon, options.delta, options.samples, options.seed, options.workers, remote
        )
        named = {"noise_multiplier": result.value, "epsilon": options.epsilon, "target_epsilon": options.epsilon}
    else:
        result = epsilon_minsep(
            process, options.noise_multiplier, options.delta, options.samples, options.seed, options.workers, remote
        )
        named = {"noise_multiplier": options.noise_multiplier, "epsilon": result.value}
    return {
        "mechanism": "bandmf-minsep",
        "steps": options.steps,
        "sampling_prob": options.sampling_prob,
        "min_sep": options.min_sep,
        "bands": options.bands,
        "strategy": options.strategy,
        "coefficients": list(bands),
        "max_contributions": options.max_contributions,
        **named,
        **result.report(sigma_fixed=isinstance(options, EpsilonOptions)),
        "target_delta": options.delta,
        "seed": options.seed,
        "workers": options.workers,
        "runner": options.runner,
        "accountant": "Monte Carlo with estimate-verify-release (b-min-sep paper, App. A)",
        "wall_time_s": round(time.perf_counter() - started, 3),
    }


def _accounting(options: CalibrateOptions | EpsilonOptions, runner_options: list[str]) -> dict:
    """What `madp calibrate` (sigma for the target epsilon) or `madp epsilon` (epsilon at the given sigma)
    prints; `runner_options`: the options of the Beam runner that draws bandmf-minsep's Monte Carlo samples."""
    from madp.accounting.calibrate import calibrate, finite_epsilon

    if options.mechanism == "bandmf-minsep":
        return _minsep(options, runner_options)
    if options.runner != LOCAL or runner_options:
        raise OptionError(
            "{runner} and runner options apply to bandmf-minsep only (got {0} {1})", options.runner, runner_options
        )
    mechanism = _mechanism(options)
    result = {
        "mechanism": mechanism.name,
        **dataclasses.asdict(mechanism),
        "delta": options.delta,
        "strategy": options.strategy if options.mechanism.startswith("bandmf") else None,
        "dataset_size": options.dataset_size,
        "num_users": options.num_users,
        "batch_size": options.batch_size,
        "cohort_size": options.cohort_size,
    }
    if isinstance(options, EpsilonOptions):
        return {
            **result,
            "noise_multiplier": options.noise_multiplier,
            "epsilon": finite_epsilon(mechanism, options.noise_multiplier, options.delta),
        }
    calibration = calibrate(mechanism, options.epsilon, options.delta, options.tolerance)
    return {
        **result,
        "noise_multiplier": calibration.noise_multiplier,
        "epsilon": calibration.epsilon,
        "target_epsilon": options.epsilon,
        "relative_tolerance": options.tolerance,
        "accountant": "PLD (dp_accounting), pessimistic discretization",
    }


def _calibrate(args: argparse.Namespace, runner_options: list[str]) -> dict:
    return _accounting(options_from(CalibrateOptions, args), runner_options)


def _epsilon(args: argparse.Namespace, runner_options: list[str]) -> dict:
    return _accounting(options_from(EpsilonOptions, args), runner_options)


def _recommend(args: argparse.Namespace, unknown: list[str]) -> dict:
    """The sweep as JSON on stdout, its table on stderr; with --write-config, the job of the recommended k."""
    import sys

    from madp.core.reports import VERSION_KEY
    from madp.stages.recommending import job_config_of, run_recommend_k
    from madp.tools.planning.recommend import Sweep, table

    options = options_from(RecommendOptions, args)
    sweep = Sweep(
        options.epsilon,
        options.delta,
        options.steps,
        options.batch_size,
        options.mechanism,
        options.min_sep,
        options.bands,
        options.strategy,
        options.clip_norm,
        options.ks,
        options.order,
        options.seed,
        options.columns,
        options.truncation_share,
    )
    config = job_config_of(
        options.write_config,
        options.run_dir,
        options.model,
        options.labels,
        options.label_column,
        options.text_column,
    )
    result = run_recommend_k(args.input, sweep, config, show=lambda result: print(table(result), file=sys.stderr))
    return {key: value for key, value in result.to_json().items() if key != VERSION_KEY}  # the file's, not printed


FAMILY = Family(
    add_parsers,
    {"calibrate": _calibrate, "epsilon": _epsilon, "strategy": _strategy, "recommend-k": _recommend},
    runner_options=frozenset({"calibrate", "epsilon"}),
)
