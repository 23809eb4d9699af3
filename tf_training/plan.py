"""What a training run's guarantee is, before any training: the options of `madp train`, and the
privacy plan (mechanism, sigma, epsilon, delta) that the batches' reports and the accountant
imply. No TensorFlow here, so `madp run` can calibrate without it and the plan can be checked
against the batches it describes (their SHA-256 hashes are part of it).
"""
from __future__ import annotations

import dataclasses
import json
import logging

import numpy as np

from accounting.calibrate import calibrate, epsilon
from accounting.evr import calibrate_minsep, epsilon_minsep, unamplified
from accounting.mechanisms import BandMf, DpSgd, DpSgdUls, Mechanism
from accounting.monte_carlo import MinSepProcess
from accounting.strategies import coefficients as strategy_coefficients
from madp import storage
from madp.records import InputError
from tf_training.batches import Batches

log = logging.getLogger("madp.train")
MECHANISMS = ("auto", "dpsgd", "bandmf", "none")
DISTRIBUTIONS = ("default", "mirrored", "tpu")


@dataclasses.dataclass(frozen=True)
class TrainOptions:
    epsilon: float | None = None
    delta: float = 1e-5
    noise_multiplier: float | None = None
    mechanism: str = "auto"
    bands: int = 1
    strategy: str = "sqrt"
    model: str = "logreg"
    features: str = "features"
    label: str = "label"
    optimizer: str = "sgd"
    learning_rate: float = 0.5
    clip_norm: float = 1.0
    seed: int = 0
    eval_data: str | None = None
    eval_every: int = 100
    max_contributions: int | None = None
    amplified: bool = False
    mc_samples: int | None = None
    mc_workers: int = 1
    distribution: str = "default"
    tpu: str = ""
    cpu_replicas: int = 1
    calibration: str | None = None

    def __post_init__(self) -> None:
        checks = [(self.mechanism in MECHANISMS, f"--mechanism must be one of {MECHANISMS}"),
                  (self.bands >= 1, "--bands must be at least 1"),
                  (self.optimizer in ("sgd", "adam"), "--optimizer must be sgd or adam"),
                  (self.learning_rate > 0, "--learning-rate must be positive"),
                  (self.clip_norm > 0, "--clip-norm must be positive"),
                  (self.eval_every >= 1, "--eval-every must be at least 1"),
                  (self.mechanism == "none" or self.calibration is not None or self.epsilon is not None
                   or self.noise_multiplier is not None,
                   "give --epsilon (sigma is calibrated), --noise-multiplier, or --calibration"),
                  (self.calibration is None or (self.epsilon is None and self.noise_multiplier is None),
                   "--calibration fixes sigma: drop --epsilon and --noise-multiplier"),
                  (self.noise_multiplier is None or self.noise_multiplier > 0, "--noise-multiplier must be positive"),
                  (not self.amplified or self.mechanism in ("auto", "bandmf"),
                   "--amplified accounts BandMF: use --mechanism auto or bandmf"),
                  (self.distribution in DISTRIBUTIONS, f"--distribution must be one of {DISTRIBUTIONS}"),
                  (self.cpu_replicas >= 1 and (self.cpu_replicas == 1 or self.distribution == "mirrored"),
                   "--cpu-replicas must be at least 1, and above 1 only with --distribution mirrored"),
                  (self.mc_workers >= 1, "--mc-workers must be at least 1")]
        for ok, message in checks:
            if not ok:
                raise InputError(message)


# --- privacy ------------------------------------------------------------------------------------

def contribution_bound(batches: Batches, override: int | None) -> int:
    """K: records (copies) per user at most, from the bounding report next to SELECTED."""
    if override is not None:
        return override
    path = storage.join(batches.report.get("selected", ""), "report.json")
    if storage.kind(path) != "file":
        raise InputError(f"no bounding report at {path}: give --max-contributions")
    return int(json.loads(storage.read_text(path))["parameters"]["max_contributions"])


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


def noise_multiplier_for(mechanism: Mechanism, options: TrainOptions) -> tuple[float, float]:
    """(sigma, epsilon delivered at options.delta)."""
    if options.noise_multiplier is not None:
        delivered = epsilon(mechanism, options.noise_multiplier, options.delta)
        _warn_override(options, delivered)
        return options.noise_multiplier, delivered
    result = calibrate(mechanism, options.epsilon, options.delta)
    return result.noise_multiplier, result.epsilon


def _warn_override(options: TrainOptions, delivered: float) -> None:
    log.warning("--noise-multiplier %g overrides calibration: this run delivers epsilon %.4g at delta %g",
                options.noise_multiplier, delivered, options.delta)


def amplified_noise_multiplier(batches: Batches, options: TrainOptions, fallback: BandMf) -> tuple[float, float, dict]:
    """(sigma, epsilon, Monte Carlo details) for b-min-sep Poisson batches with amplification
    (`bandmf-minsep`: estimate-verify-release, the unamplified `fallback` when verification fails)."""
    if batches.report["sampler"] != "minsep":
        raise InputError("--amplified needs b-min-sep Poisson batches (--sampler minsep)")
    process = MinSepProcess(fallback.steps, fallback.min_sep, float(batches.report["sampling_probability"]),
                            fallback.records_per_step, fallback.coefficients)
    log.info("Monte Carlo accounting (estimate-verify-release) for %s", process)
    if options.noise_multiplier is not None:
        result = epsilon_minsep(process, options.noise_multiplier, epsilon(fallback, options.noise_multiplier,
                                                                             options.delta),
                                options.delta, options.mc_samples, options.seed, options.mc_workers)
        sigma, delivered = options.noise_multiplier, result.value
        _warn_override(options, delivered)
    else:
        result = calibrate_minsep(process, calibrate(fallback, options.epsilon, options.delta).noise_multiplier,
                                  options.epsilon, options.delta, options.mc_samples, options.seed, options.mc_workers)
        sigma, delivered = result.value, options.epsilon
    details = {"process": dataclasses.asdict(process), "verified": result.verified, "fallback": result.fallback, "samples": result.samples,
               "estimate_samples": result.estimate_samples, "base_delta": result.base_delta,
               "released_delta": result.overall_delta, "ladder": list(result.ladder), "outcomes": list(result.outcomes)}
    return sigma, delivered, details




# --- the plan -----------------------------------------------------------------------------------

def privacy_plan(batches: Batches, options: TrainOptions) -> dict:
    """Mechanism, sigma and the guarantee for training on `batches` with `options` (privacy.json)."""
    if options.mechanism == "none":
        return {"mechanism": "none"}
    user_level = batches.report["sampler"] == "users"
    bands = tuple(strategy_coefficients(options.strategy, batches.steps, options.bands).tolist())
    k = None if user_level else contribution_bound(batches, options.max_contributions)
    mechanism = mechanism_for(batches, options, bands, k)
    monte_carlo = None
    if options.amplified:
        if mechanism.name != "bandmf":
            raise InputError(f"--amplified accounts BandMF on b-min-sep batches; these batches train as "
                             f"{mechanism.name}")
        sigma, delivered, monte_carlo = amplified_noise_multiplier(batches, options, mechanism)
    else:
        sigma, delivered = noise_multiplier_for(mechanism, options)
    plan = {"mechanism": "bandmf-minsep" if monte_carlo else mechanism.name,
            "parameters": dataclasses.asdict(mechanism),
            "noise_multiplier": sigma, "epsilon": delivered, "target_epsilon": options.epsilon,
            "delta": options.delta, "steps": batches.steps, "clip_norm": options.clip_norm,
            "expected_batch_size": batches.expected_batch_size, "bands": list(bands),
            "strategy": options.strategy,
            "noise_stddev_of_mean_gradient": sigma * options.clip_norm / batches.expected_batch_size,
            "contribution_bound": k,
            "min_sep": int(batches.report["parameters"]["min_sep"]), "sampler": batches.report["sampler"],
            "batch_files_sha256": batches.file_hashes(),
            "accountant": "Monte Carlo with estimate-verify-release (b-min-sep paper, App. A)" if monte_carlo
            else "PLD (dp_accounting)"}
    if monte_carlo:
        plan.update(parameters=monte_carlo.pop("process"), monte_carlo=monte_carlo,
                    delta=monte_carlo["released_delta"], target_delta=options.delta)
    return plan


def epsilon_curve(plan: dict, points: int = 9) -> list[list[float]]:
    """[sigma, epsilon at the plan's delta] from sigma/2 to 2 sigma, for the report (PLD on a 10x coarser grid,
    still an upper bound). Monte Carlo plans are drawn with their unamplified fallback, the formal bound."""
    if plan["mechanism"] == "none":
        return []
    parameters = {k: tuple(v) if isinstance(v, list) else v for k, v in plan["parameters"].items()}
    mechanism = (unamplified(MinSepProcess(**parameters)) if plan["mechanism"] == "bandmf-minsep" else
                 {"dpsgd": DpSgd, "dpsgd-uls": DpSgdUls, "bandmf": BandMf}[plan["mechanism"]](**parameters))
    sigmas = plan["noise_multiplier"] * 2.0 ** ((np.arange(points) - points // 2) / (points // 2))
    return [[float(s), epsilon(mechanism, float(s), plan.get("target_delta", plan["delta"]), discretization=1e-2)]
            for s in sigmas]


def plan_for(batches: Batches, options: TrainOptions) -> dict:
    """The plan of `options.calibration` (checked against the batches and the clip norm), else a new one."""
    if options.calibration is None:
        return privacy_plan(batches, options)
    plan = json.loads(storage.read_text(options.calibration))
    if plan.get("batch_files_sha256") != batches.file_hashes():
        raise InputError(f"--calibration {options.calibration} describes other batch files than {batches.directory}")
    if plan["clip_norm"] != options.clip_norm:
        raise InputError(f"--calibration {options.calibration} is for clip norm {plan['clip_norm']}, "
                         f"not --clip-norm {options.clip_norm}")
    return {**plan, "calibration": options.calibration}
