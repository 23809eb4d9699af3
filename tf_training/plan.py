"""What a training run's guarantee is, before any training: the privacy plan (mechanism, sigma,
epsilon, delta) that the batches' reports and the accountant imply. No TensorFlow here, so
`madp run` can calibrate without it and the plan can be checked against the batches it describes
(what the accounting read from their report is part of it; no digest of their content).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from typing import Any

import numpy as np
from scipy.stats import binom

from madp.accounting.calibrate import calibrate, epsilon
from madp.accounting.evr import calibrate_minsep, epsilon_minsep, unamplified
from madp.accounting.mechanisms import BandMf, DpSgd, DpSgdUls, Mechanism
from madp.accounting.monte_carlo import MinSepProcess
from madp.accounting.strategies import coefficients as strategy_coefficients
from madp.core import storage
from madp.core.batch_files import TRAININGS_FILE
from madp.core.errors import InputError
from madp.core.randomness import FIXED_SEED
from madp.core.selection import REPORT_FILE
from madp.training.batches import Batches
from madp.training.options import TrainOptions

log = logging.getLogger("madp.train")


def contribution_bound(batches: Batches, override: int | None) -> int:
    """K for the accountant: the most records (copies) any user can have in the selection the batches
    were made from, as `madp batch` recorded it (the bound's largest capacity or K, and at least the
    largest contribution the bound found). `--max-contributions` may raise it, never lower it."""
    bound = batches.report.get("bound") or {}
    _check_selection_unchanged(batches, bound)
    recorded = max(
        (int(v) for v in (bound.get("contribution_bound"), bound.get("max_user_contribution")) if v is not None),
        default=None,
    )
    if override is not None and recorded is not None and override < recorded:
        raise InputError(
            f"--max-contributions {override} is below what the batches were made from: users may "
            f"have up to {recorded} records in {batches.report.get('selected')} (its bound report); "
            f"the guarantee would not hold"
        )
    if override is not None:
        return override
    if recorded is None:
        raise InputError(
            f"the batches record no bounding report of {batches.report.get('selected')}: give --max-contributions"
        )
    return recorded


def _check_selection_unchanged(batches: Batches, bound: dict) -> None:
    """A SELECTED re-bounded after batching no longer describes the batches: refuse to guess which holds."""
    selected = batches.report.get("selected", "")
    path = storage.join(selected, REPORT_FILE)
    if storage.kind(path) != "file":
        return  # SELECTED moved or removed: the batches' own record stands
    if json.loads(storage.read_text(path)).get("selection_files") != bound.get("selection_files"):
        raise InputError(
            f"{selected} changed since {batches.directory} was made from it (its selection files "
            f"differ): re-run madp batch on the new selection, or restore the old one"
        )


def warn_delta(delta: float, batches: Batches) -> None:
    users = (batches.report.get("bound") or {}).get("input_users")
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
    max_batch = report["parameters"].get("max_batch_size")
    if max_batch is None:
        return 0.0
    if report["sampler"] == "users":
        raise InputError("--max-batch-size truncation of user-sampled batches is not accounted: re-batch without it")
    rho = min(
        1.0, batches.steps * float(binom.sf(max_batch, int(report["units"]), float(report["sampling_probability"])))
    )
    return rho * (1 + math.exp(epsilon_))


def mechanism_for(batches: Batches, options: TrainOptions, bands: tuple[float, ...], k: int | None) -> Mechanism:
    """The accounting mechanism the batches and options imply.

    - b-min-sep Poisson batches with b = 1 and one band: DP-SGD with example-level sampling and up
      to K records per user (ELS mixture of Gaussians);
    - otherwise BandMF without amplification: at most ceil(T/b) participations, each with up to K
      records of the user (Poisson batches), or the greedy's k with one record per step.
    """
    report, steps = batches.report, batches.steps
    if report["sampler"] == "users":
        if len(bands) > 1 or options.mechanism == "bandmf":
            raise InputError("user-level (--sampler users) batches train with DP-SGD: use --bands 1")
        return DpSgdUls(float(report["sampling_probability"]), steps)
    if k is None:
        raise ValueError("record-level batches are accounted with their contribution bound k")
    min_sep = int(report["parameters"]["min_sep"])
    if report["sampler"] == "minsep":
        if options.mechanism in ("auto", "dpsgd") and min_sep == 1 and len(bands) == 1:
            return DpSgd(float(report["sampling_probability"]), steps, k)
        if options.mechanism == "dpsgd":
            raise InputError("--mechanism dpsgd needs --min-sep 1 batches and --bands 1")
        return BandMf(steps, min_sep, 1 + (steps - 1) // min_sep, bands, records_per_step=k)
    if options.mechanism == "dpsgd":
        raise InputError("--mechanism dpsgd needs Poisson (minsep) batches; greedy batches are accounted as BandMF")
    return BandMf(steps, min_sep, int(report["k"]), bands, records_per_step=1)


def _mechanism_delta(options: TrainOptions, truncation) -> float:
    """The delta left for the mechanism once truncation's share of the target delta is set aside."""
    share = truncation(options.epsilon)
    if share >= options.delta / 2:
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
    if share >= options.delta / 2:
        raise InputError(
            f"--noise-multiplier {options.noise_multiplier:g} delivers epsilon {delivered:.4g}, but truncation "
            f"at --max-batch-size adds delta {share:.3g} to the {options.delta:g} asked for (steps over B_max "
            f"are too likely): raise --max-batch-size in madp batch, or drop it"
        )
    return delta + share


def noise_multiplier_for(mechanism: Mechanism, options: TrainOptions, truncation) -> tuple[float, float, float]:
    """(sigma, epsilon, delta of the released guarantee); `truncation(epsilon)` is the delta truncation adds."""
    if options.noise_multiplier is not None:
        delivered = epsilon(mechanism, options.noise_multiplier, options.delta)
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


def amplified_noise_multiplier(
    batches: Batches, options: TrainOptions, unamplified_: BandMf, truncation
) -> tuple[float, float, float, dict]:
    """(sigma, epsilon, delta, Monte Carlo details) for b-min-sep Poisson batches with amplification
    (`bandmf-minsep`: estimate-verify-release, unamplified BandMF when verification fails)."""
    if batches.report["sampler"] != "minsep":
        raise InputError("--amplified needs b-min-sep Poisson batches (--sampler minsep)")
    process = MinSepProcess(
        unamplified_.steps,
        unamplified_.min_sep,
        float(batches.report["sampling_probability"]),
        unamplified_.records_per_step,
        unamplified_.coefficients,
    )
    log.info("Monte Carlo accounting (estimate-verify-release) for %s", process)
    if options.noise_multiplier is not None:
        result = epsilon_minsep(
            process, options.noise_multiplier, options.delta, options.mc_samples, options.mc_seed, options.mc_workers
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
        )
        sigma, delivered = result.value, options.target_epsilon
    details = {
        "process": dataclasses.asdict(process),
        "seed": options.mc_seed,
        **result.report(sigma_fixed=options.noise_multiplier is not None),
    }
    total = _with_truncation(options, delivered, details["delta"], truncation)
    if options.noise_multiplier is not None:
        _warn_override(options, delivered, total)
    return sigma, delivered, total, details


# --- the plan -----------------------------------------------------------------------------------

PRIVACY_UNIT = "a user, with every record attributed to them (user-level DP over multi-attribution records)"
RELATION = (
    "fixed-graph zero-out: the neighbouring dataset replaces every record of one user by a record with "
    "zero gradient; both have the same user-record graph, which the guarantee treats as public (keep it "
    "confidential in practice)"
)
AMPLIFIED = ("dpsgd", "dpsgd-uls", "bandmf-minsep")  # accounted with amplification by secret sampling


def privacy_plan(batches: Batches, options: TrainOptions) -> dict:
    """Mechanism, sigma and the guarantee for training on `batches` with `options` (privacy.json)."""
    if options.mechanism == "none":
        return {"mechanism": "none", "private": False}
    warn_delta(options.delta, batches)
    report = batches.report
    user_level = report["sampler"] == "users"
    bands = tuple(strategy_coefficients(options.strategy, batches.steps, options.bands).tolist())
    k = None if user_level else contribution_bound(batches, options.max_contributions)
    mechanism = mechanism_for(batches, options, bands, k)
    if options.amplified and not isinstance(mechanism, BandMf):
        raise InputError(f"--amplified accounts BandMF on b-min-sep batches; these batches train as {mechanism.name}")
    name = "bandmf-minsep" if options.amplified else mechanism.name
    amplified = name in AMPLIFIED
    truncation = (lambda eps: truncation_delta(batches, eps)) if amplified else (lambda eps: 0.0)
    monte_carlo = None
    if options.amplified:
        assert isinstance(mechanism, BandMf)  # refused above otherwise
        sigma, delivered, delta, monte_carlo = amplified_noise_multiplier(batches, options, mechanism, truncation)
    else:
        sigma, delivered, delta = noise_multiplier_for(mechanism, options, truncation)
    sampling = report.get("sampling", FIXED_SEED)  # batches from before secret keys used a fixed seed
    plan = {
        "mechanism": name,
        "parameters": dataclasses.asdict(mechanism),
        "noise_multiplier": sigma,
        "epsilon": delivered,
        "target_epsilon": options.epsilon,
        "delta": delta,
        "target_delta": options.delta,
        "truncation_delta": truncation(delivered),
        "privacy_unit": PRIVACY_UNIT,
        "neighbouring_relation": RELATION,
        "assumptions": assumptions(report, name, k),
        "sampling": sampling,
        "relies_on_secret_sampling": amplified,
        "steps": batches.steps,
        "clip_norm": options.clip_norm,
        "expected_batch_size": batches.expected_batch_size,
        "bands": list(bands),
        "strategy": options.strategy,
        "noise_stddev_of_mean_gradient": sigma * options.clip_norm / batches.expected_batch_size,
        "contribution_bound": k,
        "min_sep": int(report["parameters"]["min_sep"]),
        "sampler": report["sampler"],
        "accounted_batches": accounted_batches(report),
        "accountant": "Monte Carlo with estimate-verify-release (b-min-sep paper, App. A)"
        if monte_carlo
        else "PLD (dp_accounting)",
    }
    if monte_carlo:
        plan.update(parameters=monte_carlo.pop("process"), monte_carlo=monte_carlo)
    return plan


def accounted_batches(report: dict) -> dict:
    """Everything the accounting reads from a batch report; a plan applies to batches whose record equals
    its own. It holds no digest of the batch files: the plan is published (privacy.json, calibration.json)
    and a hash of the training content would hide that content only computationally. Batches that agree
    here (a re-batching with a fresh key) are accounted identically, so the plan holds for them too."""
    bound = report.get("bound") or {}
    return {
        "sampler": report["sampler"],
        "steps": report["steps"],
        "units": report.get("units"),
        "sampling_probability": report.get("sampling_probability"),
        "sampling": report.get("sampling"),
        "k": report.get("k"),
        "parameters": report["parameters"],
        "contribution_bound": bound.get("contribution_bound"),
        "max_user_contribution": bound.get("max_user_contribution"),
    }


def assumptions(report: dict, mechanism: str, k: int | None) -> list[str]:
    """What the guarantee of training on these batches rests on, step by step."""
    sampler = report["sampler"]
    stated = [
        f"every user has at most {k} records (copies) in the data trained on: the bound's K or largest "
        f"capacity, checked by madp verify-bound"
        if k is not None
        else "every record has exactly one user (user-level sampling, one clipped gradient per user)"
    ]
    rejected = {reason: n for reason, n in ((report.get("bound") or {}).get("rejected") or {}).items() if n}
    if rejected:
        stated.append(
            f"the bound dropped invalid rows ({', '.join(f'{r}: {n}' for r, n in sorted(rejected.items()))}; "
            f"--on-invalid skip): which rows are valid, which can depend on a row's content (invalid_json "
            f"covers a whole row), is treated as public like the graph of the valid rows"
        )
    bound_parameters = (report.get("bound") or {}).get("parameters") or {}
    if bound_parameters.get("order") == "weight":
        stated.append(
            f"the bounding ordered records by the content column {bound_parameters.get('weight_column')!r} "
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
    if report["parameters"].get("max_batch_size") is not None:
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
    """The assumption a text classifier adds when its label set came from the batches (no --labels)."""
    return (
        f"the label set {labels} was read from the rows of the batches (no --labels; the schedule is public "
        f"for this mechanism): the model and its metrics disclose it, so it is treated as public; give "
        f"--labels to fix it in advance"
    )


def _formal_mechanism(plan: dict) -> Mechanism:
    """The plan's mechanism for PLD accounting; a Monte Carlo plan's unamplified fallback, its formal bound."""
    parameters: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in plan["parameters"].items()}
    if plan["mechanism"] == "bandmf-minsep":
        return unamplified(MinSepProcess(**parameters))
    return {"dpsgd": DpSgd, "dpsgd-uls": DpSgdUls, "bandmf": BandMf}[plan["mechanism"]](**parameters)


def epsilon_curve(plan: dict, points: int = 9) -> list[list[float]]:
    """[sigma, epsilon at the plan's delta] from sigma/2 to 2 sigma, for the report (PLD on a 10x coarser grid,
    still an upper bound). Monte Carlo plans are drawn with their unamplified fallback, the formal bound."""
    if plan["mechanism"] == "none":
        return []
    mechanism = _formal_mechanism(plan)
    sigmas = plan["noise_multiplier"] * 2.0 ** ((np.arange(points) - points // 2) / (points // 2))
    return [[float(s), epsilon(mechanism, float(s), plan["target_delta"], discretization=1e-2)] for s in sigmas]


def plan_for(batches: Batches, options: TrainOptions) -> dict:
    """The plan of `options.calibration` (checked against the batches and the clip norm), else a new one."""
    if options.calibration is None:
        return privacy_plan(batches, options)
    plan = json.loads(storage.read_text(options.calibration))
    if plan.get("accounted_batches") != accounted_batches(batches.report):
        raise InputError(
            f"--calibration {options.calibration} accounts for other batches than {batches.directory} "
            f"(their sampler, steps, sampling probability, units, parameters or bound differ): calibrate again"
        )
    if plan["clip_norm"] != options.clip_norm:
        raise InputError(
            f"--calibration {options.calibration} is for clip norm {plan['clip_norm']}, "
            f"not --clip-norm {options.clip_norm}"
        )
    return {**plan, "calibration": options.calibration}


# --- trainings on one batch output ---------------------------------------------------------------


def earlier_trainings(batches_dir: str) -> list[dict]:
    """The private trainings recorded on this batch output (`record_training`), oldest first."""
    path = storage.join(batches_dir, TRAININGS_FILE)
    if storage.kind(path) != "file":
        return []
    try:
        trainings = [json.loads(line) for line in storage.read_text(path).splitlines() if line.strip()]
    except ValueError as error:
        raise InputError(f"{path}: not a ledger madp wrote ({error}); the batches' trainings are unknown") from None
    if not all(isinstance(t, dict) and {"mechanism", "parameters", "noise_multiplier"} <= set(t) for t in trainings):
        raise InputError(f"{path}: not a ledger madp wrote (an entry lacks mechanism, parameters or sigma)")
    return trainings


def record_training(batches_dir: str, output: str, plan: dict) -> None:
    """Append a finished private training to the batch output's ledger of trainings."""
    entry = {key: plan.get(key) for key in ("mechanism", "parameters", "noise_multiplier", "epsilon", "delta")}
    lines = [json.dumps(t) for t in earlier_trainings(batches_dir)] + [json.dumps({"output": output, **entry})]
    storage.write_text(storage.join(batches_dir, TRAININGS_FILE), "\n".join(lines) + "\n")


def composition(plan: dict, earlier: list[dict]) -> dict:
    """The guarantee of this training and the `earlier` ones on the same batches, released together.

    They share the batches, hence the sampling: n Gaussian releases of one sampled batch with noise
    multipliers sigma_i are n stacked queries of sensitivity 1 each, i.e. one query of sensitivity
    sqrt(n)-equivalent, dominated by the same mechanism at sigma = (sum sigma_i^-2)^(-1/2). With
    amplification this is far worse than twice epsilon (the same secret sampling is used again), which
    is why independent batches are the better way to train twice. Trainings of another mechanism or
    parameters have no such closed form: no figure is given for them."""
    runs = [*earlier, plan]
    same = all(t["mechanism"] == plan["mechanism"] and t["parameters"] == plan["parameters"] for t in earlier)
    result: dict[str, Any] = {"trainings": len(runs), "outputs": [t.get("output") for t in earlier]}
    if not same:
        return {**result, "epsilon": None, "note": "other mechanisms or parameters: no composed figure"}
    sigma = sum(t["noise_multiplier"] ** -2 for t in runs) ** -0.5
    mechanism_delta = plan["delta"] - plan["truncation_delta"]
    composed = epsilon(_formal_mechanism(plan), sigma, mechanism_delta)
    rho = plan["truncation_delta"] / (1 + math.exp(plan["epsilon"]))  # one truncation event, shared by all runs
    accountant = "unamplified fallback (PLD)" if plan["mechanism"] == "bandmf-minsep" else "PLD"
    return {
        **result,
        "equivalent_noise_multiplier": sigma,
        "epsilon": composed,
        "delta": mechanism_delta + rho * (1 + math.exp(composed)),
        "accountant": accountant,
    }
