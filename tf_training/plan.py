"""What a training run's guarantee is, before any training: the privacy plan (mechanism, sigma,
epsilon, delta) that the batches' reports and the accountant imply. No TensorFlow here, so
`madp run` can calibrate without it and the plan can be checked against the batches it describes
(what the accounting read from their report is part of it; no digest of their content).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from madp.accounting import truncation as truncation_bound
from madp.accounting.calibrate import calibrate, epsilon, finite_epsilon
from madp.accounting.evr import calibrate_minsep, epsilon_minsep, unamplified
from madp.accounting.mechanisms import BandMf, DpSgd, DpSgdUls, Mechanism
from madp.accounting.monte_carlo import MinSepProcess
from madp.accounting.strategies import coefficients as strategy_coefficients
from madp.core import storage
from madp.core.errors import InputError, OptionError
from madp.core.randomness import FIXED_SEED
from madp.core.reports import BatchReport, BoundRecord
from madp.core.selection import REPORT_FILE, read_bound_report
from madp.core.user_ids import AS_IS, EMAIL
from madp.training.batches import Batches
from madp.training.options import TrainOptions

log = logging.getLogger("madp.train")


def contribution_bound(batches: Batches, override: int | None) -> int:
    """K for the accountant: the most records (copies) any user can have in the selection the batches
    were made from, as `madp batch` recorded it (the bound's largest capacity or K, and at least the
    largest contribution the bound found). `--max-contributions` may raise it, never lower it."""
    bound = batches.report.bound
    _check_selection_unchanged(batches, bound)
    recorded = None if bound is None else max(bound.contribution_bound, bound.max_user_contribution)
    if override is not None and recorded is not None and override < recorded:
        raise OptionError(
            "{max_contributions} {0} is below what the batches were made from: users may have up to {1} "
            "records in {2} (its bound report); the guarantee would not hold",
            override,
            recorded,
            batches.report.selected,
        )
    if override is not None:
        return override
    if recorded is None:
        raise OptionError(
            "the batches record no bounding report of {0}: give {max_contributions}", batches.report.selected
        )
    return recorded


def _check_selection_unchanged(batches: Batches, bound: BoundRecord | None) -> None:
    """A SELECTED re-bounded after batching no longer describes the batches: refuse to guess which holds."""
    selected = batches.report.selected
    path = storage.join(selected, REPORT_FILE)
    if storage.kind(path) != "file":
        return  # SELECTED moved or removed: the batches' own record stands
    if read_bound_report(selected).selection_files != (None if bound is None else bound.selection_files):
        raise InputError(
            f"{selected} changed since {batches.directory} was made from it (its selection files "
            f"differ): re-run madp batch on the new selection, or restore the old one"
        )


def _warn_delta(delta: float, batches: Batches) -> None:
    users = None if batches.report.bound is None else batches.report.bound.input_users
    if users and delta > 1 / users:
        log.warning("delta %g exceeds 1/%d users: a mechanism could release one user's data in the clear", delta, users)


def truncation_delta(batches: Batches, epsilon_: float) -> float:
    """The delta that truncating steps to B_max adds to an amplified guarantee (0 without truncation).

    Truncated and untruncated training differ only on the event E that some step samples more than
    B_max units. Under the fixed-graph zero-out relation E has the same probability rho for both
    neighbours (it depends on the graph and the sampling only), so coupling the two runs gives
    (epsilon, delta + rho (1 + e^epsilon)). A step's batch is a subset of its Bernoulli(p) sample of
    all U units, so rho <= T Pr[Binomial(U, p) > B_max]."""
    report = batches.report
    max_batch = report.parameters.max_batch_size
    if max_batch is None:
        return 0.0
    if report.sampler == "users":
        raise InputError("--max-batch-size truncation of user-sampled batches is not accounted: re-batch without it")
    return truncation_bound.truncation_delta(
        batches.steps, int(report.units), _probability(batches), int(max_batch), epsilon_
    )


def _mechanism_for(batches: Batches, options: TrainOptions, bands: tuple[float, ...], k: int | None) -> Mechanism:
    """The accounting mechanism the batches and options imply.

    - b-min-sep Poisson batches with b = 1 and one band: DP-SGD with example-level sampling and up
      to K records per user (ELS mixture of Gaussians);
    - otherwise BandMF without amplification: at most ceil(T/b) participations, each with up to K
      records of the user (Poisson batches), or the greedy's k with one record per step.
    """
    report, steps = batches.report, batches.steps
    if report.sampler == "users":
        if len(bands) > 1 or options.mechanism == "bandmf":
            raise OptionError("user-level (--sampler users) batches train with DP-SGD: use {bands} 1")
        return DpSgdUls(_probability(batches), steps)
    if k is None:
        raise ValueError("record-level batches are accounted with their contribution bound k")
    min_sep = int(report.parameters.min_sep)
    if report.sampler == "minsep":
        if options.mechanism in ("auto", "dpsgd") and min_sep == 1 and len(bands) == 1:
            return DpSgd(_probability(batches), steps, k)
        if options.mechanism == "dpsgd":
            raise OptionError("{mechanism} dpsgd needs --min-sep 1 batches and {bands} 1")
        return BandMf(steps, min_sep, 1 + (steps - 1) // min_sep, bands, records_per_step=k)
    if options.mechanism == "dpsgd":
        raise OptionError("{mechanism} dpsgd needs Poisson (minsep) batches; greedy batches are accounted as BandMF")
    if report.k is None:
        raise InputError(f"{batches.directory}: its report records no k of the greedy batches: batch again")
    return BandMf(steps, min_sep, int(report.k), bands, records_per_step=1)


def _probability(batches: Batches) -> float:
    """p of Poisson-sampled batches, which their report must record."""
    if batches.report.sampling_probability is None:
        raise InputError(f"{batches.directory}: its report records no sampling probability: batch again")
    return float(batches.report.sampling_probability)


def _mechanism_delta(options: TrainOptions, truncation) -> float:
    """The delta left for the mechanism once truncation's share of the target delta is set aside."""
    share = truncation(options.epsilon)
    if share >= truncation_bound.REFUSED_SHARE * options.delta:
        raise InputError(
            f"truncation at --max-batch-size costs delta {share:.3g} of the {options.delta:g} asked for "
            f"(steps over B_max are too likely): raise --max-batch-size in madp batch, or drop it"
        )
    return options.delta - share


def _with_truncation(options: TrainOptions, delivered: float, delta: float, truncation) -> float:
    """The delta of a guarantee at a given sigma once truncation's share is added; refused where that
    share would take half of the delta asked for or more, as calibration refuses it (a "delta" of 16
    is no guarantee, whatever epsilon says)."""
    share = truncation(delivered)
    if share >= truncation_bound.REFUSED_SHARE * options.delta:
        raise OptionError(
            "{noise_multiplier} {0:g} delivers epsilon {1:.4g}, but truncation at --max-batch-size adds delta "
            "{2:.3g} to the {3:g} asked for (steps over B_max are too likely): raise --max-batch-size in madp "
            "batch, or drop it",
            options.noise_multiplier,
            delivered,
            share,
            options.delta,
        )
    return delta + share


def _noise_multiplier_for(mechanism: Mechanism, options: TrainOptions, truncation) -> tuple[float, float, float]:
    """(sigma, epsilon, delta of the released guarantee); `truncation(epsilon)` is the delta truncation adds."""
    if options.noise_multiplier is not None:
        delivered = finite_epsilon(mechanism, options.noise_multiplier, options.delta)
        total = _with_truncation(options, delivered, options.delta, truncation)
        _warn_override(options, delivered, total)
        return options.noise_multiplier, delivered, total
    result = calibrate(mechanism, options.target_epsilon, _mechanism_delta(options, truncation))
    return result.noise_multiplier, result.epsilon, options.delta


def _warn_override(options: TrainOptions, delivered: float, delta: float) -> None:
    log.warning(
        "--noise-multiplier %g overrides calibration: this run delivers epsilon %.4g at delta %.3g",
        options.noise_multiplier,
        delivered,
        delta,
    )


def _amplified_noise_multiplier(
    batches: Batches, options: TrainOptions, unamplified_: BandMf, truncation
) -> tuple[float, float, float, MinSepProcess, dict]:
    """(sigma, epsilon, delta, the process accounted, Monte Carlo details) for b-min-sep Poisson batches with
    amplification (`bandmf-minsep`: estimate-verify-release, unamplified BandMF when verification fails)."""
    if batches.report.sampler != "minsep":
        raise OptionError("{amplified} needs b-min-sep Poisson batches (--sampler minsep)")
    process = MinSepProcess(
        unamplified_.steps,
        unamplified_.min_sep,
        _probability(batches),
        unamplified_.records_per_step,
        unamplified_.coefficients,
    )
    log.info("Monte Carlo accounting (estimate-verify-release) for %s", process)
    remote = None
    if options.mc_runner == "cuda":
        from madp.accounting.monte_carlo_cuda import gpu_task_map

        remote = gpu_task_map()
    if options.noise_multiplier is not None:
        result = epsilon_minsep(
            process,
            options.noise_multiplier,
            options.delta,
            options.mc_samples,
            options.mc_seed,
            options.mc_workers,
            remote,
        )
        sigma, delivered = options.noise_multiplier, result.value
    else:
        result = calibrate_minsep(
            process,
            options.target_epsilon,
            _mechanism_delta(options, truncation),
            options.mc_samples,
            options.mc_seed,
            options.mc_workers,
            remote,
        )
        sigma, delivered = result.value, options.target_epsilon
    details = {
        "seed": options.mc_seed,
        **result.report(sigma_fixed=options.noise_multiplier is not None),
    }
    total = _with_truncation(options, delivered, details["delta"], truncation)
    if options.noise_multiplier is not None:
        _warn_override(options, delivered, total)
    return sigma, delivered, total, process, details


# --- the plan -----------------------------------------------------------------------------------

PRIVACY_UNIT = "a user, with every record attributed to them (user-level DP over multi-attribution records)"
RELATION = (
    "fixed-graph zero-out: the neighbouring dataset replaces every record of one user by a record with "
    "zero gradient; both have the same user-record graph, which the guarantee treats as public (keep it "
    "confidential in practice)"
)
AMPLIFIED = ("dpsgd", "dpsgd-uls", "bandmf-minsep")  # accounted with amplification by secret sampling
NOT_PRIVATE = {"mechanism": "none", "private": False}  # privacy.json of a non-private training: it has no plan

# The parameters' class of each mechanism a plan names; bandmf-minsep's are the Monte Carlo process.
PARAMETERS: dict[str, Callable[..., Mechanism | MinSepProcess]] = {
    "dpsgd": DpSgd,
    "dpsgd-uls": DpSgdUls,
    "bandmf": BandMf,
    "bandmf-minsep": MinSepProcess,
}


def parameters_of(mechanism: str, parameters: dict[str, Any]) -> Mechanism | MinSepProcess:
    """A plan's `parameters` from their JSON (`to_json`), for the mechanism it names: KeyError or TypeError
    where they are not that mechanism's."""
    return PARAMETERS[mechanism](**{k: tuple(v) if isinstance(v, list) else v for k, v in parameters.items()})


def to_json(value: Any) -> Any:
    """A plan, or a part of it, as its JSON files hold it: dataclasses as objects in field order (a field
    whose default is None left out while None), tuples as lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            field.name: to_json(getattr(value, field.name))
            for field in dataclasses.fields(value)
            if not (field.default is None and getattr(value, field.name) is None)
        }
    if isinstance(value, (list, tuple)):
        return [to_json(item) for item in value]
    if isinstance(value, dict):
        return {key: to_json(item) for key, item in value.items()}
    return value


@dataclasses.dataclass(frozen=True)
class AccountedBatches:
    """Everything the accounting reads from a batch report; a plan applies to batches whose record equals
    its own. It holds no digest of the batch files: the plan is published (privacy.json, calibration.json)
    and a hash of the training content would hide that content only computationally. Batches that agree
    here (a re-batching with a fresh key) are accounted identically, so the plan holds for them too."""

    sampler: str  # how steps were drawn: minsep (Poisson), minsep-greedy or users
    steps: int  # T, the training steps
    units: int | None  # how many units (records, or users for --sampler users) a step samples from
    sampling_probability: float | None  # p, the probability a step samples a unit (Poisson samplers)
    sampling: str | None  # what the sampling rests on: a secret key, a fixed seed, or nothing (greedy)
    k: int | None  # greedy: the participations of a record
    parameters: dict[str, Any]  # `madp batch`'s parameters (min_sep, max_batch_size, ...) as its report has them
    contribution_bound: int | None  # the bound's K or largest capacity, as `madp bound` reported it
    max_user_contribution: int | None  # the most records one user has in the selection


@dataclasses.dataclass(frozen=True)
class Guarantee:
    """An (epsilon, delta) guarantee: the one of a single training, where privacy.json states a composition."""

    epsilon: float  # the single training's epsilon
    delta: float  # everything, the mechanism's delta and truncation's


@dataclasses.dataclass(frozen=True)
class Composition:
    """The guarantee of a training and the earlier ones on the same selection, released together (`composition`)."""

    trainings: int  # this one and the earlier ones
    outputs: tuple[str | None, ...]  # the earlier trainings' output directories, oldest first
    # (sum of sigma_i^-2)^(-1/2) over this training and the earlier ones on the same batches: one training at
    # it dominates them all
    equivalent_noise_multiplier: float
    epsilon: float  # the composed epsilon, PLD accounting
    delta: float  # the mechanism's delta plus that of truncation (one event, shared by all), at that epsilon
    accountant: str  # "PLD", or "unamplified fallback (PLD)" where a Monte Carlo plan is composed
    # other batch outputs of the selection whose trainings composed with these as independent releases
    independent_batches: int | None = None


@dataclasses.dataclass(frozen=True)
class PrivacyPlan:
    """The mechanism, sigma and guarantee of a private training: calibration.json, privacy.json (where the
    trainer adds the noise, whether the model is private, and any composition) and the trainings ledger.

    Its JSON (`to_json`) is what users and independent verifiers read: field names and order are that
    file's keys, the fields defaulting to None appear only where set. A non-private training has no plan
    (privacy.json is NOT_PRIVATE). Frozen: change one with `dataclasses.replace`.

    Args:
        mechanism: dpsgd, dpsgd-uls, bandmf or bandmf-minsep; `parameters` what the accountant accounts.
        noise_multiplier: sigma; `epsilon` and `delta` the guarantee (`target_epsilon`, `target_delta`
            what was asked for, `truncation_delta` truncation's share of `delta`).
        steps: T; with `clip_norm`, `expected_batch_size`, `bands`, `strategy`, `min_sep`, `sampler`,
            `contribution_bound` and `accounted_batches` what the training and its batches must be.
        assumptions: what the guarantee rests on, as sentences; with `privacy_unit`,
            `neighbouring_relation`, `sampling`, `relies_on_secret_sampling` and `accountant` how it is
            stated. The fields after them (`epsilon_curve`, `calibration`, `noise`, `private`,
            `single_training`, `composition`, `trained_on`, ...) default to None; each field's comment
            where it is declared says what it holds.

    Returns:
        Made by `calibrate` (or `madp.calibrate`), read back by `PrivacyPlan.from_json`, not by hand.

    Raises:
        ValueError: (`from_json`) data that is no plan madp wrote.

    Example:
        >>> import json, madp, tempfile
        >>> from madp.tools.data.synthetic import GraphSpec, generate, write_dataset
        >>> work, spec = tempfile.mkdtemp(), GraphSpec(records=400, features=4, seed=1)
        >>> _ = write_dataset(generate(spec), spec, f"{work}/records.parquet", shards=1)
        >>> _ = madp.bound(f"{work}/records.parquet", f"{work}/bounded", max_contributions=3)
        >>> _ = madp.batch(f"{work}/bounded", f"{work}/records.parquet", f"{work}/batches", steps=12,
        ...                batch_size=8, min_sep=2, seed=0)  # seed: reproducible, NOT private
        >>> from madp.training import PrivacyPlan, calibrate, open_batches
        >>> plan = calibrate(open_batches(f"{work}/batches"), epsilon=8, delta=1e-5, bands=2)
        >>> plan.mechanism, plan.epsilon <= 8, plan.delta, plan.steps, plan.clip_norm
        ('bandmf', True, 1e-05, 12, 1.0)
        >>> PrivacyPlan.from_json(json.loads(json.dumps(plan.to_json()))) == plan
        True
    """

    mechanism: str  # dpsgd, dpsgd-uls, bandmf, or bandmf-minsep (BandMF amplified, Monte Carlo accounted)
    parameters: Mechanism | MinSepProcess  # what the accountant accounts: the mechanism, or the Monte Carlo process
    noise_multiplier: float  # sigma: the noise's standard deviation in units of the clip norm
    epsilon: float  # the guarantee's epsilon (after a composition, the composed one)
    target_epsilon: float | None  # --epsilon (None where --noise-multiplier fixed sigma)
    delta: float  # the guarantee's whole delta: the mechanism's plus truncation_delta (or the composed one)
    target_delta: float  # --delta, what was asked for
    truncation_delta: float  # the delta truncation to --max-batch-size adds at `epsilon` (0 without it)
    privacy_unit: str  # what one neighbour differs in: a user (PRIVACY_UNIT)
    neighbouring_relation: str  # how the neighbouring dataset is made (RELATION)
    assumptions: tuple[str, ...]  # what the guarantee rests on, as sentences
    sampling: str  # what the batches' sampling rests on: a secret key, a fixed seed, or nothing (greedy)
    relies_on_secret_sampling: bool  # accounted with amplification: the sampling must stay secret
    steps: int  # T, the training steps
    clip_norm: float  # C, the clip norm of a gradient (per record, or per user with --sampler users)
    expected_batch_size: float  # what the noisy sum of a step is divided by
    bands: tuple[float, ...]  # BandMF's bands of C ((1.0,) for DP-SGD's noise)
    strategy: str  # how the bands were chosen: sqrt or optimized
    noise_stddev_of_mean_gradient: float  # sigma * clip norm / expected batch size
    contribution_bound: int | None  # k: records (copies) per user the accountant assumes (None: user-level)
    min_sep: int  # b: steps between a user's participations
    sampler: str  # minsep, minsep-greedy or users
    accounted_batches: AccountedBatches  # the batches this plan applies to
    accountant: str  # "PLD (dp_accounting)", or Monte Carlo with estimate-verify-release
    monte_carlo: dict[str, Any] | None = None  # bandmf-minsep: the estimate-verify-release record (evr's report)
    epsilon_curve: tuple[tuple[float, float], ...] | None = None  # calibration.json: (sigma, epsilon at target delta)
    calibration: str | None = None  # the calibration.json trained with (--calibration)
    noise: str | None = None  # privacy.json: where the noise came from (a fresh key, --noise-seed, or scaled)
    private: bool | None = None  # privacy.json: whether the model holds the guarantee (fresh noise and sampling)
    single_training: Guarantee | None = None  # privacy.json, after a composition: this training's own guarantee
    composition: Composition | None = None  # privacy.json: the composition of this and earlier trainings
    trained_on: str | None = None  # the batch output the plan is for (its selection keeps the trainings ledger)

    def to_json(self) -> dict[str, Any]:
        """The plan as its files hold it, ready for json.dumps."""
        return to_json(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PrivacyPlan:
        """The plan `to_json` gave (a privacy.json or calibration.json read back); ValueError if it is none."""
        try:
            curve, single, composed = data.get("epsilon_curve"), data.get("single_training"), data.get("composition")
            return cls(
                **{
                    **data,
                    "parameters": parameters_of(data["mechanism"], data["parameters"]),
                    "assumptions": tuple(data["assumptions"]),
                    "bands": tuple(data["bands"]),
                    "accounted_batches": AccountedBatches(**data["accounted_batches"]),
                    "epsilon_curve": None if curve is None else tuple((s, e) for s, e in curve),
                    "single_training": None if single is None else Guarantee(**single),
                    "composition": None
                    if composed is None
                    else Composition(**{**composed, "outputs": tuple(composed["outputs"])}),
                }
            )
        except (KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"not a privacy plan madp wrote ({type(error).__name__}: {error})") from None

    @property
    def formal_mechanism(self) -> Mechanism:
        """The mechanism for PLD accounting; a Monte Carlo plan's unamplified fallback, its formal bound."""
        if isinstance(self.parameters, MinSepProcess):
            return unamplified(self.parameters)
        return self.parameters


def privacy_json(plan: PrivacyPlan | None) -> dict[str, Any]:
    """What privacy.json states of a training under `plan`; of a non-private one (None), that it has no plan.

    Args:
        plan: the training's plan (`step.plan`), or None for a non-private training.

    Returns:
        The JSON-ready dict, the plan's `to_json()` or {"mechanism": "none", "private": False}.

    Raises:
        Nothing.

    Example:
        >>> from madp.training import privacy_json
        >>> privacy_json(None)
        {'mechanism': 'none', 'private': False}

    A private training's (`make_private`)::

        json.dumps(privacy_json(step.plan))
    """
    return dict(NOT_PRIVATE) if plan is None else plan.to_json()


def stated_plan(data: dict[str, Any]) -> PrivacyPlan | None:
    """The plan a privacy.json or calibration.json states; None for a non-private training's (no plan)."""
    return None if data.get("mechanism") == NOT_PRIVATE["mechanism"] else PrivacyPlan.from_json(data)


def privacy_plan(batches: Batches, options: TrainOptions) -> PrivacyPlan | None:
    """Mechanism, sigma and the guarantee for training on `batches` with `options` (privacy.json); None
    for a non-private training."""
    if options.mechanism == "none":
        return None
    _warn_delta(options.delta, batches)
    report = batches.report
    user_level = report.sampler == "users"
    bands = tuple(strategy_coefficients(options.strategy, batches.steps, options.bands).tolist())
    k = None if user_level else contribution_bound(batches, options.max_contributions)
    mechanism = _mechanism_for(batches, options, bands, k)
    if options.amplified and not isinstance(mechanism, BandMf):
        raise OptionError(
            "{amplified} accounts BandMF on b-min-sep batches; these batches train as {0}", mechanism.name
        )
    name = "bandmf-minsep" if options.amplified else mechanism.name
    amplified = name in AMPLIFIED
    truncation = (lambda eps: truncation_delta(batches, eps)) if amplified else (lambda eps: 0.0)
    parameters: Mechanism | MinSepProcess = mechanism
    monte_carlo = None
    if options.amplified:
        assert isinstance(mechanism, BandMf)  # refused above otherwise
        sigma, delivered, delta, parameters, monte_carlo = _amplified_noise_multiplier(
            batches, options, mechanism, truncation
        )
    else:
        sigma, delivered, delta = _noise_multiplier_for(mechanism, options, truncation)
    return PrivacyPlan(
        mechanism=name,
        parameters=parameters,
        noise_multiplier=sigma,
        epsilon=delivered,
        target_epsilon=options.epsilon,
        delta=delta,
        target_delta=options.delta,
        truncation_delta=truncation(delivered),
        privacy_unit=PRIVACY_UNIT,
        neighbouring_relation=RELATION,
        assumptions=tuple(assumptions(report, name, k)),
        sampling=report.sampling or FIXED_SEED,  # batches from before secret keys used a fixed seed
        relies_on_secret_sampling=amplified,
        steps=batches.steps,
        clip_norm=options.clip_norm,
        expected_batch_size=batches.expected_batch_size,
        bands=bands,
        strategy=options.strategy,
        noise_stddev_of_mean_gradient=sigma * options.clip_norm / batches.expected_batch_size,
        contribution_bound=k,
        min_sep=int(report.parameters.min_sep),
        sampler=report.sampler,
        accounted_batches=accounted_batches(report),
        accountant="Monte Carlo with estimate-verify-release (b-min-sep paper, App. A)"
        if monte_carlo
        else "PLD (dp_accounting)",
        monte_carlo=monte_carlo,
    )


def accounted_batches(report: BatchReport) -> AccountedBatches:
    """What the accounting reads from a batch `report` (`AccountedBatches`)."""
    bound = report.bound
    return AccountedBatches(
        sampler=report.sampler,
        steps=report.steps,
        units=report.units,
        sampling_probability=report.sampling_probability,
        sampling=report.sampling,
        k=report.k,
        parameters=report.parameters.to_json(),
        contribution_bound=None if bound is None else bound.contribution_bound,
        max_user_contribution=None if bound is None else bound.max_user_contribution,
    )


def assumptions(report: BatchReport, mechanism: str, k: int | None) -> list[str]:
    """What the guarantee of training on these batches rests on, step by step."""
    sampler = report.sampler
    stated = [
        f"every user has at most {k} records (copies) in the data trained on: the bound's K or largest "
        f"capacity, checked by madp verify-bound"
        if k is not None
        else "every record has exactly one user (user-level sampling, one clipped gradient per user)"
    ]
    bound = report.bound
    rejected = {reason: n for reason, n in (bound.rejected if bound else {}).items() if n}
    if rejected:
        stated.append(
            f"the bound dropped invalid rows ({', '.join(f'{r}: {n}' for r, n in sorted(rejected.items()))}; "
            f"--on-invalid skip): which rows are valid, which can depend on a row's content (invalid_json "
            f"covers a whole row), is treated as public like the graph of the valid rows"
        )
    bound_parameters = None if bound is None else bound.parameters
    user_ids = None if bound_parameters is None else bound_parameters.user_ids
    if user_ids == EMAIL:
        stated.append(
            "user ids were read as e-mail addresses (--user-ids email: display names dropped, values split at "
            "',' and ';', stripped, lower-cased): one address is one user"
        )
    elif user_ids == AS_IS:
        stated.append(
            "user ids were taken as they are (--user-ids as-is, not checked for one person written two ways): "
            "distinct ids are distinct people, as the operator stated"
        )
    if bound_parameters is not None and bound_parameters.order == "weight":
        stated.append(
            f"the bounding ordered records by the content column {bound_parameters.weight_column!r} "
            f"(--order weight): that column is treated as public, like the graph (which records were kept, "
            f"and the bound report, depend on it)"
        )
    if sampler == "minsep":
        stated.append(
            "the sampling probability p was calibrated from neighbourhood sizes, a function of the graph only"
        )
    if sampler == "minsep-greedy":
        stated.append("the greedy min-sep schedule is a function of the graph only")
    if mechanism in AMPLIFIED:
        stated.append("amplification by subsampling: which units each step sampled stays secret")
    else:
        stated.append(f"{mechanism} is accounted without amplification: knowing the schedule costs nothing")
    if report.parameters.max_batch_size is not None:
        stated.append(
            "truncation to --max-batch-size: "
            + (
                "its delta (truncation_delta) is added"
                if mechanism in AMPLIFIED
                else "only removes contributions, within the unamplified bound"
            )
        )
    return stated


def labels_read_from_data(labels: list[str]) -> str:
    """The assumption a classifier adds to its plan when its label set came from the batches' rows.

    Without --labels, the model and its metrics disclose the set. Where the schedule is secret (Poisson
    or b-min-sep sampling) a set read from the sampled rows would reveal which records were sampled, so
    give the labels in advance there.

    Args:
        labels: the label set read from the rows.

    Returns:
        The assumption, a sentence for the plan's `assumptions`.

    Raises:
        Nothing.

    Example:
        >>> from madp.training import labels_read_from_data
        >>> labels_read_from_data(["cat", "dog"])
        "the label set ['cat', 'dog'] was read from the rows of the batches ...; give --labels to fix it in advance"

    Added to a plan::

        plan = dataclasses.replace(plan, assumptions=(*plan.assumptions, labels_read_from_data(labels)))
    """
    return (
        f"the label set {labels} was read from the rows of the batches (no --labels; the schedule is public "
        f"for this mechanism): the model and its metrics disclose it, so it is treated as public; give "
        f"--labels to fix it in advance"
    )


def pretrained_is_public(path: str) -> str:
    """The assumption a training adds when it starts from a pretrained model (--pretrained).

    It names the model by its SHA-256 (a GGUF file's, as `sha256sum` prints it; a preset directory's over
    each file's name and SHA-256, `storage.content_digest`, hidden files such as a downloader's cache or
    .git left out), so that a reader can check which model it was, and a --resume with other files at the
    same path is under another plan, refused. Take it before reading the model and compare it with one
    taken after, as `madp train` does, so that it names the files trained from.

    Args:
        path: the pretrained model: a GGUF file or a preset directory, local or remote.

    Returns:
        The assumption, a sentence for the plan's `assumptions` that names `path` and its SHA-256.

    Raises:
        madp.core.errors.InputError: a path that cannot be read, named in the message.

    Example:
        >>> import os, tempfile
        >>> from madp.training import pretrained_is_public
        >>> path = os.path.join(tempfile.mkdtemp(), "model.gguf")
        >>> _ = open(path, "wb").write(b"GGUF")
        >>> named = pretrained_is_public(path)  # before reading the model
        >>> "SHA-256 b83633aa785344791618f2fddf131b010ea04912a60430760b070bad293f65bd" in named
        True

    Added to a plan::

        plan = dataclasses.replace(plan, assumptions=(*plan.assumptions, named))
    """
    if storage.kind(path) == "file":
        digest = storage.sha256(path)
    else:
        digest = storage.content_digest(path, skip_hidden=True)
    return (
        f"the pretrained model {path} (--pretrained, SHA-256 {digest}) was not trained "
        f"on the private records: its weights and tokenizer are public, and the model trained here holds or "
        f"reads them"
    )


def epsilon_curve(plan: PrivacyPlan, points: int = 9) -> tuple[tuple[float, float], ...]:
    """(sigma, epsilon at the plan's delta) from sigma/2 to 2 sigma, for the report (PLD on a 10x coarser grid,
    still an upper bound). Monte Carlo plans are drawn with their unamplified fallback, the formal bound."""
    mechanism = plan.formal_mechanism
    sigmas = plan.noise_multiplier * 2.0 ** ((np.arange(points) - points // 2) / (points // 2))
    return tuple((float(s), epsilon(mechanism, float(s), plan.target_delta, discretization=1e-2)) for s in sigmas)


def plan_for(batches: Batches, options: TrainOptions) -> PrivacyPlan | None:
    """The plan of `options.calibration` (checked against the batches and the clip norm), else a new one;
    either is for `batches.directory` (`trained_on`: its selection keeps the ledger a private training enters)."""
    if options.calibration is None:
        plan = privacy_plan(batches, options)
        return None if plan is None else dataclasses.replace(plan, trained_on=batches.directory)
    stated = json.loads(storage.read_text(options.calibration))
    # Compared as JSON before it is read as a plan: a file of another shape is for other batches too.
    if stated.get("accounted_batches") != to_json(accounted_batches(batches.report)):
        raise OptionError(
            "{calibration} {0} accounts for other batches than {1} (their sampler, steps, sampling probability, "
            "units, parameters or bound differ): calibrate again",
            options.calibration,
            batches.directory,
        )
    try:
        plan = PrivacyPlan.from_json(stated)
    except ValueError as error:
        raise OptionError("{calibration} {0}: {1}", options.calibration, error) from None
    if plan.clip_norm != options.clip_norm:
        raise OptionError(
            "{calibration} {0} is for clip norm {1}, not {clip_norm} {2}",
            options.calibration,
            plan.clip_norm,
            options.clip_norm,
        )
    return dataclasses.replace(plan, calibration=options.calibration, trained_on=batches.directory)
