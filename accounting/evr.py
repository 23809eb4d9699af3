"""Estimate-verify-release (b-min-sep paper, App. A) with sequential verification by betting.

A candidate (a noise multiplier, or a claimed epsilon at a fixed one) is verified when, in both
directions, an anytime-valid betting test (`accounting/betting.py`) rejects "delta(epsilon) >= delta*"
on fresh Monte Carlo samples at level q_k: a candidate that is not (epsilon, delta*)-DP passes with
probability at most q_k, however early the test stops. Candidates are tried from the lowest up, the
k-th at q_k = q / 2^(k+1), and the first that passes is released, else the formally accounted
fallback (calibrated at delta*). Some candidate that is not (epsilon, delta*)-DP passes with
probability at most sum_k q_k < q, so the release is (epsilon, delta* + q (1 - delta*))-DP
(Theorem A.1's argument), with delta* + q (1 - delta*) = delta for q = FAILURE_SHARE * delta.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from collections.abc import Callable

from madp.accounting.betting import samples_to_reject_on_zeros
from madp.accounting.calibrate import calibrate
from madp.accounting.calibrate import epsilon as epsilon_of
from madp.accounting.mc_delta import CHUNK, RemoteMap, estimate_passes, task_map, verify
from madp.accounting.mechanisms import BandMf, Mechanism
from madp.accounting.monte_carlo import DIRECTIONS, DeltaReduction, MinSepProcess, delta_reduction
from madp.core.errors import InputError

log = logging.getLogger("madp.accounting")

FAILURE_SHARE = 0.02  # q = 2% of the target delta; delta* = (delta - q) / (1 - q)
# Candidates: the estimate times 1 + 1%, 2%, 4%, ..., 32%, tried from the lowest.
RUNG_STEPS = tuple(0.01 * 2**j for j in range(6))
# The estimate places the ladder: delta* / 2 on ESTIMATE_SAMPLES w / delta* samples (at least
# ESTIMATE_MIN_SAMPLES), whose error moves sigma by about 1%.
ESTIMATE_TARGET = 0.5
ESTIMATE_SAMPLES = 8
ESTIMATE_MIN_SAMPLES = 65_536
BISECTION_STEPS = 11
COARSENING = 16  # the estimate first finds 16x the target on 1/16 of the samples
DEFAULT_SLOPE = -0.05  # d log value / d log delta when no two estimates measured it (sigma: ~-0.03)
# A verification's sample budget: by default VERIFY_BUDGET times what all-zero terms need.
VERIFY_BUDGET = 4


def release_deltas(delta: float) -> tuple[float, float]:
    """(delta*, q): candidates are judged (epsilon, delta*)-DP, and one that is not is released with
    probability at most q; delta* + q (1 - delta*) = delta."""
    if not 0 < delta < 1:
        raise InputError(f"delta must be in (0, 1), got {delta}")
    failure = FAILURE_SHARE * delta
    return (delta - failure) / (1 - failure), failure


def rung_level(failure: float, rung: int) -> float:
    """Level of the test of the rung-th candidate tried: the levels sum to less than `failure`."""
    return failure / 2 ** (rung + 1)


def default_samples(delta: float) -> int:
    """The sample budget of one verification, per direction."""
    mechanism_delta, failure = release_deltas(delta)
    return VERIFY_BUDGET * samples_to_reject_on_zeros(mechanism_delta, rung_level(failure, 0))


@dataclasses.dataclass(frozen=True)
class MinSepRelease:
    """What Algorithm 5 released: a noise multiplier (calibrate) or an epsilon (inverse).

    Args:
        value: the released noise multiplier (`calibrate_minsep`) or epsilon (`epsilon_minsep`).
        verified: whether the Monte Carlo verification passed (False: the formal fallback was released).
        fallback: the unamplified fallback's value; estimate: the Monte Carlo estimate.
        ladder, outcomes, samples_used: the candidates tried, from the lowest, and their verifications.
        samples, estimate_samples: the sample budgets.
        mechanism_delta, failure_probability, overall_delta: delta*, q, and the guarantee's delta.
        attempts: runs of this same calibration in the attempts ledger, this one included.
        reductions: the variance reductions used, per direction.

    Returns:
        The release's immutable record; `report(sigma_fixed)` is what the outputs state of it.

    Raises:
        Nothing: `calibrate_minsep` and `epsilon_minsep` make it.

    Example:
        >>> from madp.accounting import MinSepProcess, calibrate_minsep, coefficients
        >>> process = MinSepProcess(20, 4, 0.1, 1, tuple(coefficients("sqrt", 20, 2)))
        >>> release = calibrate_minsep(process, epsilon=4.0, delta=1e-3, seed=0)
        >>> release.verified, release.value < release.fallback  # amplification: less noise than unamplified
        (True, True)
    """

    value: float
    verified: bool  # False: the formally accounted fallback was released
    fallback: float
    estimate: float
    ladder: tuple[float, ...]
    outcomes: tuple[bool, ...]  # verification of each candidate tried, from the lowest
    samples_used: tuple[int, ...]  # samples each of those verifications drew, per direction
    samples: int  # sample budget of one verification, per direction
    estimate_samples: int  # per estimate and direction
    mechanism_delta: float  # delta*: candidates and fallback are judged (epsilon, delta*)-DP
    failure_probability: float  # q: chance that some candidate which is not passes verification
    overall_delta: float  # delta* + q (1 - delta*): the delta of Algorithm 5's guarantee
    attempts: int  # runs of this same calibration in the attempts ledger, this one included
    reductions: tuple[DeltaReduction, ...]  # P's and Q's at the released value's epsilon (monte_carlo.DeltaReduction)

    def report(self, sigma_fixed: bool) -> dict:
        """The release as every output states it (`madp calibrate`/`epsilon`, a training's privacy plan),
        with the fallback and the estimate named by what was released. Calibrating sigma is Algorithm 5:
        a formal (epsilon, delta* + q (1 - delta*)) guarantee. At a fixed sigma (`sigma_fixed`) a
        verified epsilon is a claim about a fixed mechanism, (epsilon, delta*), wrong with probability
        <= q; the fallback is formal."""
        if not sigma_fixed:
            delta, guarantee = self.overall_delta, "formal (Algorithm 5, estimate-verify-release)"
        elif self.verified:
            delta, guarantee = (
                self.mechanism_delta,
                (f"Monte Carlo claim at a fixed sigma: false with probability <= {self.failure_probability:.3g}"),
            )
        else:
            delta, guarantee = self.mechanism_delta, "formal (the unamplified fallback's PLD accounting)"
        released = "epsilon" if sigma_fixed else "noise_multiplier"
        return {
            f"fallback_{released}": self.fallback,
            f"estimated_{released}": self.estimate,
            "verified": self.verified,
            "guarantee": guarantee,
            "delta": delta,
            "samples": self.samples,
            "samples_used": list(self.samples_used),
            "estimate_samples": self.estimate_samples,
            "mechanism_delta": self.mechanism_delta,
            "failure_probability": self.failure_probability,
            "ladder": list(self.ladder),
            "outcomes": list(self.outcomes),
            "attempts": self.attempts,
            "variance_reduction": {
                under: {
                    "weight": reduction.weight,
                    "span": reduction.span,
                    "given_at_least_one_participation": reduction.at_least_one,
                    "certified_without_samples": reduction.certified(self.mechanism_delta),
                }
                for under, reduction in zip(DIRECTIONS, self.reductions)
            },
        }


def _estimate(estimate_passes, fallback: float, low: float, target: float, samples: int) -> tuple[float, float]:
    """(value where delta(value) ~ target, d log value / d log delta there), larger values being more private.

    `estimate_passes(value, target, samples, early=True)` -> (delta <= target, full-sample estimate, or
    None when it stopped early), with common random numbers (the same seeded chunks at every value).
    With enough samples the value is first found for COARSENING x the target on 1/COARSENING of the
    samples (recursively), then stepped to the target along the slope found there and interpolated
    log-log from one (rarely two) full-sample estimates. Otherwise the target is bracketed between
    `low` (lowered 8x at a time while it still passes) and `fallback`, bisected geometrically, and
    interpolated log-log once two full-sample estimates straddle it.
    """
    if samples // COARSENING >= 4 * CHUNK and COARSENING * target <= 0.1:
        coarse, slope = _estimate(estimate_passes, fallback, low, COARSENING * target, samples // COARSENING)
        known = (coarse, COARSENING * target)
        value = coarse * COARSENING**-slope
        for _ in range(2):
            measured = estimate_passes(value, target, samples, False)[1]
            if not measured or measured == known[1]:
                return value, slope
            slope = math.log(value / known[0]) / math.log(measured / known[1])
            known, value = (value, measured), value * (target / measured) ** slope
            if 1 / 3 <= measured / target <= 3:
                break
        return value, slope
    high = fallback
    while estimate_passes(low, target, samples)[0] and low > fallback * 1e-6:  # the bracket must hold the target
        high, low = low, low / 8
    above, below = None, None  # full-sample (value, estimate) on each side of the target
    for _ in range(BISECTION_STEPS):
        middle = math.sqrt(low * high)
        passes, estimate = estimate_passes(middle, target, samples)
        if passes:
            high = middle
            below = (middle, estimate) if estimate else below
        else:
            low = middle
            above = (middle, estimate) if estimate else above
        if above and below:
            (x0, y0), (x1, y1) = above, below
            slope = math.log(x1 / x0) / math.log(y1 / y0)
            return min(max(x0 * (target / y0) ** slope, low), high), slope
    return high, DEFAULT_SLOPE


def _estimate_verify_release(
    estimate_passes, verify_value, fallback: float, low: float, target: float, samples: int, failure: float
) -> tuple[float, float, tuple, tuple, tuple]:
    """Algorithm 5 over candidates of one parameter, larger being more private (sigma, or a claimed epsilon).

    The estimate (`_estimate`) places candidates at the estimate times 1 + RUNG_STEPS, below the
    fallback; they are tried from the lowest (rung k at level failure / 2^(k+1), `verify_value(value,
    rung, level)` -> (passed, samples)), and the first that passes is released, else the fallback.
    """
    estimate = _estimate(estimate_passes, fallback, low, target, samples)[0]
    ladder = tuple(value for value in (estimate * (1 + step) for step in RUNG_STEPS) if value < fallback)
    released, outcomes, used = fallback, [], []
    for rung, value in enumerate(ladder):
        passed, drawn = verify_value(value, rung, rung_level(failure, rung))
        outcomes.append(passed)
        used.append(drawn)
        if passed:
            released = value
            break
    return released, estimate, ladder, tuple(outcomes), tuple(used)


def unamplified(process: MinSepProcess) -> BandMf:
    """The formally accounted fallback of `process`: BandMF without amplification, with the most
    participations min-sep allows (ceil(T / b)), each with all k_u records of the user."""
    return BandMf(
        process.steps,
        process.min_sep,
        1 + (process.steps - 1) // process.min_sep,
        process.coefficients,
        records_per_step=process.max_contributions,
    )


def calibrate_minsep(
    process: MinSepProcess,
    epsilon: float,
    delta: float,
    samples: int | None = None,
    seed: int = 0,
    workers: int = 1,
    remote: RemoteMap | None = None,
    fallback: Mechanism | None = None,
) -> MinSepRelease:
    """Algorithm 5: the smallest verified noise multiplier for (epsilon, delta). The fallback, released
    when no candidate verifies, is `fallback` (default: unamplified BandMF) calibrated formally at
    delta*, as Theorem A.1 needs. Verification by betting tests in both directions. Each run is entered
    in the attempts ledger (`attempts_ledger`: $MADP_ATTEMPTS_LEDGER, else ~/.madp/), since choosing
    among runs multiplies the failure probability.

    Args:
        process: the participation process (`MinSepProcess`).
        epsilon: the target epsilon.
        delta: the guarantee's delta (delta* and q are shares of it).
        samples: the most samples one verification draws per direction (None: 4x what the test needs).
        seed: the seed of the Monte Carlo samples (public).
        workers: worker processes.
        remote: a map of the Monte Carlo chunks onto other workers (Beam's, a GPU's; None: local).
        fallback: the formally accounted mechanism released where verification fails.

    Returns:
        A `MinSepRelease` whose value is sigma.

    Raises:
        madp.core.errors.InputError: a target or delta out of range, or a fallback that cannot be
            calibrated.

    Example:
        >>> from madp.accounting import MinSepProcess, calibrate_minsep, coefficients
        >>> process = MinSepProcess(20, 4, 0.1, 1, tuple(coefficients("sqrt", 20, 2)))
        >>> release = calibrate_minsep(process, epsilon=4.0, delta=1e-3, seed=0)
        >>> release.verified, round(release.value, 2), round(release.fallback, 2)
        (True, 0.72, 1.84)
    """
    mechanism = fallback or unamplified(process)
    return _release(
        process,
        {"epsilon": epsilon},
        lambda sigma: (sigma, epsilon),
        lambda at: calibrate(mechanism, epsilon, at).noise_multiplier,
        1 / 8,
        delta,
        samples,
        seed,
        workers,
        remote,
        delta_reduction(process, epsilon, "P").weight,
    )


def epsilon_minsep(
    process: MinSepProcess,
    noise_multiplier: float,
    delta: float,
    samples: int | None = None,
    seed: int = 0,
    workers: int = 1,
    remote: RemoteMap | None = None,
    fallback: Mechanism | None = None,
) -> MinSepRelease:
    """The smallest epsilon that verifies at `noise_multiplier` (fallback: the formal epsilon of `fallback`,
    default unamplified BandMF, at delta*). Sigma is fixed, so this is no Algorithm 5 release but a
    verified claim: a false epsilon is returned only if a false candidate passes, probability < q; the
    result states (epsilon, delta*) with that failure probability.

    Args:
        process: the participation process (`MinSepProcess`).
        noise_multiplier: sigma.
        delta: the guarantee's delta.
        samples: the most samples one verification draws per direction (None: 4x what the test needs).
        seed: the seed of the Monte Carlo samples (public).
        workers: worker processes.
        remote: a map of the Monte Carlo chunks onto other workers (None: local).
        fallback: the formally accounted mechanism whose epsilon is released where verification fails.

    Returns:
        A `MinSepRelease` whose value is epsilon.

    Raises:
        madp.core.errors.InputError: sigma or delta out of range.

    Example:
        >>> from madp.accounting import MinSepProcess, coefficients, epsilon_minsep
        >>> process = MinSepProcess(20, 4, 0.1, 1, tuple(coefficients("sqrt", 20, 2)))
        >>> release = epsilon_minsep(process, noise_multiplier=2.0, delta=1e-3, seed=0)
        >>> release.verified, round(release.value, 2), round(release.fallback, 2)
        (True, 0.71, 3.61)
    """
    mechanism = fallback or unamplified(process)
    return _release(
        process,
        {"noise_multiplier": noise_multiplier},
        lambda eps: (noise_multiplier, eps),
        lambda at: epsilon_of(mechanism, noise_multiplier, at),
        1 / 1000,
        delta,
        samples,
        seed,
        workers,
        remote,
    )


def _release(
    process: MinSepProcess,
    target: dict,
    sigma_epsilon: Callable[[float], tuple[float, float]],
    fallback_at: Callable[[float], float],
    low: float,
    delta: float,
    samples: int | None,
    seed: int,
    workers: int,
    remote: RemoteMap | None,
    estimate_weight: float = 1.0,
) -> MinSepRelease:
    """Algorithm 5 over one parameter; `sigma_epsilon(value)` is the (sigma, epsilon) a candidate value
    claims, `fallback_at(delta*)` the formally valid value, and the search starts at `low` times it.
    `estimate_weight` is P's DeltaReduction weight where every candidate has the same epsilon, else 1."""
    mechanism_delta, failure = release_deltas(delta)
    fewest = samples_to_reject_on_zeros(mechanism_delta, rung_level(failure, 0))
    samples = default_samples(delta) if samples is None else samples  # 0 is refused below, not the default
    if samples < fewest:
        raise InputError(
            f"{samples} samples cannot verify delta {delta:g}: even a mechanism with delta 0 needs "
            f"{fewest} (the default budget is {default_samples(delta)})"
        )
    # Terms weighted by w (monte_carlo.DeltaReduction) need w times the samples for the same relative error.
    estimate_samples = max(math.ceil(ESTIMATE_SAMPLES * estimate_weight / mechanism_delta), ESTIMATE_MIN_SAMPLES)
    fallback = fallback_at(mechanism_delta)
    with task_map(workers, remote) as mapper:
        released, estimate, ladder, outcomes, used = _estimate_verify_release(
            lambda value, target, count, early=True: estimate_passes(
                process, *sigma_epsilon(value), count, (seed, 0), mapper, target, early
            ),
            lambda value, rung, level: verify(
                process, *sigma_epsilon(value), samples, (seed, 1, rung), mapper, mechanism_delta, level
            ),
            fallback,
            fallback * low,
            ESTIMATE_TARGET * mechanism_delta,
            estimate_samples,
            failure,
        )
    attempts = record_attempt(
        process,
        {"request": {**target, "delta": delta, "samples": samples}, "seed": seed, "released": released},
    )
    return MinSepRelease(
        released,
        released < fallback,
        fallback,
        estimate,
        ladder,
        outcomes,
        used,
        samples,
        estimate_samples,
        mechanism_delta,
        failure,
        mechanism_delta + failure * (1 - mechanism_delta),
        attempts,
        tuple(delta_reduction(process, sigma_epsilon(released)[1], under) for under in DIRECTIONS),
    )


# --- the attempts ledger ------------------------------------------------------------------------


def attempts_ledger() -> str:
    """Where every Monte Carlo calibration is recorded: $MADP_ATTEMPTS_LEDGER, else ~/.madp/."""
    return os.environ.get("MADP_ATTEMPTS_LEDGER") or os.path.join(
        os.path.expanduser("~"), ".madp", "monte-carlo-attempts.jsonl"
    )


def mechanism_key(process: MinSepProcess) -> str:
    """The ledger's key: the mechanism (steps, min-sep, p, records per step, bands), its numbers to 4
    significant digits. Not the request (target epsilon or sigma, delta, sample budget, seed): a user
    who changes those to try again verifies the same mechanism again, and that try must count."""

    def rounded(value: object) -> object:
        if isinstance(value, float):
            return float(f"{value:.4g}")
        if isinstance(value, (list, tuple)):
            return [rounded(v) for v in value]
        return value

    return json.dumps({k: rounded(v) for k, v in dataclasses.asdict(process).items()}, sort_keys=True)


def record_attempt(process: MinSepProcess, outcome: dict) -> int:
    """Append one Monte Carlo calibration of `process` to the ledger; return how many the ledger holds.

    A verification errs with probability q; re-running (with new seeds, another sample budget or a
    slightly different target) until one passes multiplies that by the number of tries. The ledger
    makes such tries visible (the count is in every result)."""
    path = attempts_ledger()
    key = mechanism_key(process)
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
        log.warning(
            "this mechanism was Monte Carlo calibrated %d times before (%s), whatever the target, delta or "
            "samples: choosing among runs multiplies the failure probability by their number",
            earlier,
            path,
        )
    return earlier + 1
