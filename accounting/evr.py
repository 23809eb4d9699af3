"""Estimate-verify-release arithmetic (b-min-sep paper, App. A; Chua et al., Fact 4.2).

A Monte Carlo verifier accepts a noise multiplier when its delta estimate from s samples is at
most a base delta d'. If the true divergence exceeds delta > d', the estimate (a mean of s i.i.d.
values in [0, 1]) falls to d' with probability at most q = exp(-s KL(d' || delta)) (Chernoff-
Hoeffding). Algorithm 5 then satisfies (epsilon, delta + q (1 - delta))-DP, minimized over delta.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np
from scipy.optimize import minimize_scalar

from accounting.calibrate import calibrate
from accounting.calibrate import epsilon as epsilon_of
from accounting.mechanisms import BandMf, Mechanism
from accounting.monte_carlo import MinSepProcess, hockey_stick_terms, sample_log_ratios
from madp.records import InputError

log = logging.getLogger("madp.accounting")


def bernoulli_kl(a: float, b: float) -> float:
    """KL(Bernoulli(a) || Bernoulli(b))."""
    return a * math.log(a / b) + (1 - a) * math.log((1 - a) / (1 - b))


def failure_probability(base_delta: float, delta: float, samples: int) -> float:
    """Bound on Pr[estimate <= base_delta] when the true divergence is delta > base_delta."""
    return math.exp(-samples * bernoulli_kl(base_delta, delta))


def release_deltas(base_delta: float, samples: int, target_delta: float) -> tuple[float, float]:
    """(delta*, delta* + q(delta*) (1 - delta*)) for the delta* in (base_delta, target_delta] minimizing the
    second. Theorem A.1 holds at delta*: every candidate it may release, the fallback included, must be
    (epsilon, delta*)-DP or be rejected with probability >= 1 - q(delta*)."""
    def value(log_delta: float) -> float:
        delta = math.exp(log_delta)
        return delta + failure_probability(base_delta, delta, samples) * (1 - delta)

    result = minimize_scalar(value, bounds=(math.log(base_delta) + 1e-12, math.log(target_delta)), method="bounded",
                             options={"xatol": 1e-10})
    if result.fun < value(math.log(target_delta)):
        return math.exp(result.x), float(result.fun)
    return target_delta, value(math.log(target_delta))


def overall_delta(base_delta: float, samples: int, target_delta: float) -> float:
    """min over delta in (base_delta, target_delta] of delta + q(delta) (1 - delta)."""
    return release_deltas(base_delta, samples, target_delta)[1]


def samples_needed(target_delta: float, base_delta: float) -> int:
    """Fewest Monte Carlo samples s with overall_delta(base_delta, s) <= target_delta."""
    if not 0 < base_delta < target_delta < 1:
        raise InputError(f"need 0 < base delta < target delta < 1, got {base_delta} and {target_delta}")
    low, high = 1, 2
    while overall_delta(base_delta, high, target_delta) > target_delta:
        low, high = high, 2 * high
    while high - low > 1:
        middle = (low + high) // 2
        if overall_delta(base_delta, middle, target_delta) <= target_delta:
            high = middle
        else:
            low = middle
    return high


# --- Algorithm 5: choosing sigma for BandMF with b-min-sep sampling ------------------------------

# Candidate sigmas: the estimate times 1 + 1%, 2%, 4%, ..., 32%. Verified from the top, so a
# few verifications find the lowest candidate the fresh samples confirm.
RUNG_STEPS = tuple(0.01 * 2 ** j for j in range(6))
CHUNK = 8192         # samples per task: the unit of parallelism and of seeding
# The estimate only places the ladder, so it runs on 1/8 of the verification samples (at least
# ESTIMATE_MIN_SAMPLES) and bisects to 0.1-0.4%, well inside the ladder's first 1% rung.
ESTIMATE_FRACTION = 8
ESTIMATE_MIN_SAMPLES = 65_536
BISECTION_STEPS = 11


@dataclasses.dataclass(frozen=True)
class MinSepRelease:
    """What Algorithm 5 released: a noise multiplier (calibrate) or an epsilon (inverse)."""
    value: float
    verified: bool                 # False: the formally accounted fallback was released
    fallback: float
    estimate: float
    ladder: tuple[float, ...]
    outcomes: tuple[bool, ...]     # verification of each candidate tried, from the top
    samples: int                   # per verification and direction
    estimate_samples: int          # per estimate and direction
    base_delta: float
    mechanism_delta: float         # delta*: candidates and fallback are judged (epsilon, delta*)-DP
    failure_probability: float     # q(delta*): chance that a candidate which is not passes verification
    overall_delta: float           # delta* + q (1 - delta*): the delta of Algorithm 5's guarantee
    attempts: int                  # runs of this same calibration in the attempts ledger, this one included

    def report(self, sigma_fixed: bool) -> dict:
        """The release as outputs state it. Calibrating sigma is Algorithm 5: a formal (epsilon, delta*
        + q (1 - delta*)) guarantee. At a fixed sigma (`sigma_fixed`) a verified epsilon is a claim about
        a fixed mechanism, (epsilon, delta*), wrong with probability <= q; the fallback is formal."""
        if not sigma_fixed:
            delta, guarantee = self.overall_delta, "formal (Algorithm 5, estimate-verify-release)"
        elif self.verified:
            delta, guarantee = self.mechanism_delta, (f"Monte Carlo claim at a fixed sigma: false with probability "
                                                      f"<= {self.failure_probability:.3g}")
        else:
            delta, guarantee = self.mechanism_delta, "formal (the unamplified fallback's PLD accounting)"
        return {"verified": self.verified, "guarantee": guarantee, "delta": delta, "samples": self.samples,
                "estimate_samples": self.estimate_samples, "base_delta": self.base_delta,
                "mechanism_delta": self.mechanism_delta, "failure_probability": self.failure_probability,
                "ladder": list(self.ladder), "outcomes": list(self.outcomes), "attempts": self.attempts}


def _chunk_terms(task) -> float:
    """Sum of hockey-stick terms of one seeded chunk (runs in worker processes)."""
    process, sigma, epsilon, size, seed, under = task
    return float(hockey_stick_terms(sample_log_ratios(process, sigma, size, seed, under), epsilon, under).sum())


@contextlib.contextmanager
def task_map(workers: int, beam_args: list[str] | None = None):
    """`map` over chunk tasks: in this process, in one pool of `workers` processes kept for a whole
    run, or (with `beam_args`) as one Beam pipeline per map on the runner they name."""
    if workers < 1:
        raise InputError(f"--workers must be at least 1, got {workers}")
    if beam_args is not None:
        from beam_pipelines.monte_carlo import BeamTaskMap
        with BeamTaskMap(beam_args) as mapper:
            yield mapper
    elif workers == 1:
        yield map
    else:
        with ProcessPoolExecutor(workers) as pool:
            yield pool.map


def estimate_delta(process: MinSepProcess, sigma: float, epsilon: float, samples: int, seed: tuple[int, ...],
                   mapper=map) -> float:
    """Monte Carlo delta(epsilon), the larger of both directions; chunks seeded by (seed, direction, chunk),
    so the result does not depend on how `mapper` (see `task_map`) spreads them."""
    tasks = [(process, sigma, epsilon, min(CHUNK, samples - start),
              int(np.random.SeedSequence([*seed, direction, start // CHUNK]).generate_state(1)[0]), under)
             for direction, under in enumerate(("P", "Q")) for start in range(0, samples, CHUNK)]
    started = time.perf_counter()
    sums = list(mapper(_chunk_terms, tasks))
    half = len(tasks) // 2
    delta = max(sum(sums[:half]), sum(sums[half:])) / samples
    elapsed = time.perf_counter() - started
    log.info("sigma %.6g, epsilon %.6g: delta %.4g from 2 x %d samples in %.1f s (%.0f samples/s)", sigma, epsilon,
             delta, samples, elapsed, 2 * samples / elapsed)
    return delta


def _sample_count(delta: float, samples: int | None) -> tuple[int, int, float, float, float]:
    """(verification samples, estimate samples, base delta, delta*, delta of the released guarantee)."""
    base_delta = delta / 2
    samples = samples or samples_needed(delta, base_delta)
    mechanism_delta, guarantee = release_deltas(base_delta, samples, delta)
    if guarantee > delta:
        raise InputError(f"{samples} samples give at best delta {guarantee:.3g}; need "
                         f"{samples_needed(delta, base_delta)} for delta {delta:g}")
    estimate_samples = min(samples, max(samples // ESTIMATE_FRACTION, ESTIMATE_MIN_SAMPLES))
    return samples, estimate_samples, base_delta, mechanism_delta, guarantee


def _estimate_verify_release(passes, fallback: float, low: float, seed: int) -> tuple[float, float, tuple, tuple]:
    """Algorithm 5 over candidates of one parameter, larger being more private (sigma, or a claimed epsilon).

    `passes(value, seed_tag, estimating)` runs the Monte Carlo verifier. The estimate bisects
    (geometrically, with common random numbers) between `low` (lowered 8x at a time while it still
    passes) and the formally valid `fallback`;
    candidates are the estimate times 1 + RUNG_STEPS, below the fallback, verified from the top with
    fresh samples; the lowest candidate such that it and all above it pass is released, else the
    fallback. Releasing a candidate that is not private needs the highest such candidate to pass:
    probability <= q.
    """
    high = fallback
    while passes(low, (seed, 0), True) and low > fallback * 1e-6:  # the bracket must hold the estimate
        high, low = low, low / 8
    for _ in range(BISECTION_STEPS):
        middle = math.sqrt(low * high)
        if passes(middle, (seed, 0), True):
            high = middle
        else:
            low = middle
    ladder = tuple(value for value in (high * (1 + step) for step in RUNG_STEPS) if value < fallback)
    released, outcomes = fallback, []
    for rung in range(len(ladder) - 1, -1, -1):
        outcomes.append(passes(ladder[rung], (seed, 1, rung), False))
        if not outcomes[-1]:
            break
        released = ladder[rung]
    return released, high, ladder, tuple(outcomes)


def unamplified(process: MinSepProcess) -> BandMf:
    """The formally accounted fallback of `process`: BandMF without amplification, with the most
    participations min-sep allows (ceil(T / b)), each with all k_u records of the user."""
    return BandMf(process.steps, process.min_sep, 1 + (process.steps - 1) // process.min_sep, process.coefficients,
                  records_per_step=process.max_contributions)


def calibrate_minsep(process: MinSepProcess, epsilon: float, delta: float, samples: int | None = None,
                     seed: int = 0, workers: int = 1, beam_args: list[str] | None = None,
                     fallback: Mechanism | None = None) -> MinSepRelease:
    """Algorithm 5: the smallest verified noise multiplier for (epsilon, delta). The fallback, released
    when no candidate verifies, is `fallback` (default: unamplified BandMF) calibrated formally at
    delta*, as Theorem A.1 needs. Verification at base delta delta / 2, in both directions."""
    mechanism = fallback or unamplified(process)
    return _release(process, {"epsilon": epsilon}, lambda sigma: (sigma, epsilon),
                    lambda at: calibrate(mechanism, epsilon, at).noise_multiplier, 1 / 8, delta, samples, seed,
                    workers, beam_args)


def epsilon_minsep(process: MinSepProcess, noise_multiplier: float, delta: float, samples: int | None = None,
                   seed: int = 0, workers: int = 1, beam_args: list[str] | None = None,
                   fallback: Mechanism | None = None) -> MinSepRelease:
    """The smallest epsilon that verifies at `noise_multiplier` (fallback: the formal epsilon of `fallback`,
    default unamplified BandMF, at delta*). Sigma is fixed, so this is no Algorithm 5 release but a
    verified claim: a false epsilon is returned only if the highest false candidate passes, probability
    <= q; the result states (epsilon, delta*) with that failure probability."""
    mechanism = fallback or unamplified(process)
    return _release(process, {"noise_multiplier": noise_multiplier}, lambda eps: (noise_multiplier, eps),
                    lambda at: epsilon_of(mechanism, noise_multiplier, at), 1 / 1000, delta, samples, seed, workers,
                    beam_args)


def _release(process: MinSepProcess, target: dict, sigma_epsilon, fallback_at, low: float, delta: float,
             samples: int | None, seed: int, workers: int, beam_args: list[str] | None) -> MinSepRelease:
    """Algorithm 5 over one parameter; `sigma_epsilon(value)` is the (sigma, epsilon) a candidate value
    claims, `fallback_at(delta*)` the formally valid value, and the search starts at `low` times it."""
    samples, estimate_samples, base_delta, mechanism_delta, guarantee = _sample_count(delta, samples)
    fallback = fallback_at(mechanism_delta)
    with task_map(workers, beam_args) as mapper:
        released, estimate, ladder, outcomes = _estimate_verify_release(
            lambda value, tag, estimating: estimate_delta(
                process, *sigma_epsilon(value), estimate_samples if estimating else samples, tag, mapper) <= base_delta,
            fallback, fallback * low, seed)
    attempts = record_attempt({"process": dataclasses.asdict(process), **target, "delta": delta, "samples": samples},
                              {"seed": seed, "released": released, "verified": released < fallback})
    return MinSepRelease(released, released < fallback, fallback, estimate, ladder, outcomes, samples,
                         estimate_samples, base_delta, mechanism_delta,
                         failure_probability(base_delta, mechanism_delta, samples), guarantee, attempts)


# --- the attempts ledger ------------------------------------------------------------------------

def attempts_ledger() -> str:
    """Where every Monte Carlo calibration is recorded: $MADP_ATTEMPTS_LEDGER, else ~/.madp/."""
    return os.environ.get("MADP_ATTEMPTS_LEDGER") or os.path.join(os.path.expanduser("~"), ".madp",
                                                                     "monte-carlo-attempts.jsonl")


def record_attempt(calibration: dict, outcome: dict) -> int:
    """Append one run of `calibration` to the ledger; return how many runs of it the ledger holds.

    A verification errs with probability q; re-running with new seeds until one passes multiplies
    that by the number of tries. The ledger makes such tries visible (the count is in every result)."""
    path = attempts_ledger()
    key = json.dumps(calibration, sort_keys=True, default=list)
    earlier = 0
    if os.path.exists(path):
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                try:
                    earlier += json.loads(line).get("calibration") == key
                except json.JSONDecodeError:
                    continue
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "calibration": key, **outcome}) + "\n")
    if earlier:
        log.warning("this Monte Carlo calibration ran %d times before (%s): choosing among runs multiplies the "
                    "failure probability by their number", earlier, path)
    return earlier + 1
