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

import contextlib
import dataclasses
import json
import logging
import math
import os
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor

import numpy as np

from accounting.betting import BETS, log_wealth, log_wealth_steps, samples_to_reject_on_zeros
from accounting.calibrate import calibrate
from accounting.calibrate import epsilon as epsilon_of
from accounting.mechanisms import BandMf, Mechanism
from accounting.monte_carlo import DIRECTIONS, MinSepProcess, hockey_stick_terms, sample_log_ratios
from madp.errors import InputError

log = logging.getLogger("madp.accounting")

FAILURE_SHARE = 0.02  # q = 2% of the target delta; delta* = (delta - q) / (1 - q)
# Candidates: the estimate times 1 + 1%, 2%, 4%, ..., 32%, tried from the lowest.
RUNG_STEPS = tuple(0.01 * 2**j for j in range(6))
CHUNK = 8192  # samples per task: the unit of parallelism, of seeding and of a test's stopping times
# The estimate places the ladder: delta* / 2 on ESTIMATE_SAMPLES / delta* samples (at least
# ESTIMATE_MIN_SAMPLES), whose error moves sigma by about 1%.
ESTIMATE_TARGET = 0.5
ESTIMATE_SAMPLES = 8
ESTIMATE_MIN_SAMPLES = 65_536
BISECTION_STEPS = 11
COARSENING = 16  # the estimate first finds 16x the target on 1/16 of the samples
DEFAULT_SLOPE = -0.05  # d log value / d log delta when no two estimates measured it (sigma: ~-0.03)
# A verification gives up (fails, which is always safe) when the evidence that delta > delta* reaches
# 1 / GIVE_UP_LEVEL, or after its sample budget: by default VERIFY_BUDGET times what all-zero terms need.
GIVE_UP_LEVEL = 1e-3
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
    """What Algorithm 5 released: a noise multiplier (calibrate) or an epsilon (inverse)."""

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

    def report(self, sigma_fixed: bool) -> dict:
        """The release as outputs state it. Calibrating sigma is Algorithm 5: a formal (epsilon, delta*
        + q (1 - delta*)) guarantee. At a fixed sigma (`sigma_fixed`) a verified epsilon is a claim about
        a fixed mechanism, (epsilon, delta*), wrong with probability <= q; the fallback is formal."""
        if not sigma_fixed:
            delta, guarantee = self.overall_delta, "formal (Algorithm 5, estimate-verify-release)"
        elif self.verified:
            delta, guarantee = (
                self.mechanism_delta,
                (f"Monte Carlo claim at a fixed sigma: false with probability <= {self.failure_probability:.3g}"),
            )
        else:
            delta, guarantee = self.mechanism_delta, "formal (the unamplified fallback's PLD accounting)"
        return {
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
        }


# --- chunks of samples, mapped over workers ----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ChunkTask:
    """One seeded chunk of samples at (sigma, epsilon), drawn in `directions`; with a `bound`, it also
    returns the betting tests' log wealth steps against that bound."""

    process: MinSepProcess
    sigma: float
    epsilon: float
    size: int
    seed: int
    directions: tuple[str, ...] = DIRECTIONS
    bound: float | None = None


def chunk_statistics(task: ChunkTask) -> list[list[float]]:
    """Per direction: [sum of hockey-stick terms, sum of their squares, *log wealth steps] (runs in workers)."""
    ratios = sample_log_ratios(task.process, task.sigma, task.size, task.seed, task.directions)
    statistics = []
    for under, row in zip(task.directions, ratios):
        terms = hockey_stick_terms(row, task.epsilon, under)
        steps = [] if task.bound is None else log_wealth_steps(terms, task.bound).tolist()
        statistics.append([float(terms.sum()), float(np.square(terms).sum()), *steps])
    return statistics


@dataclasses.dataclass(frozen=True)
class ChunkMap:
    """`map` over chunk tasks, `wave` tasks at a time (a sequential test looks after every wave)."""

    map: Callable
    wave: int


# Opens a `map(fn, tasks)` on a cluster for a whole run, e.g. beam_pipelines.monte_carlo.BeamTaskMap
RemoteMap = Callable[[], contextlib.AbstractContextManager[Callable]]


@contextlib.contextmanager
def task_map(workers: int, remote: RemoteMap | None = None):
    """A `ChunkMap`: in this process, in one pool of `workers` processes kept for a whole run, or on
    the cluster `remote` opens (64 tasks a wave)."""
    if workers < 1:
        raise InputError(f"--workers must be at least 1, got {workers}")
    if remote is not None:
        with remote() as mapper:
            yield ChunkMap(mapper, 64)
    elif workers == 1:
        yield ChunkMap(map, 1)
    else:
        with ProcessPoolExecutor(workers) as pool:
            yield ChunkMap(pool.map, 2 * workers)


def chunk_seed(tag: tuple[int, ...], chunk: int) -> int:
    return int(np.random.SeedSequence([*tag, chunk]).generate_state(1)[0])


def stream_chunks(
    process: MinSepProcess,
    sigma: float,
    epsilon: float,
    samples: int,
    tag: tuple[int, ...],
    mapper: ChunkMap,
    bound: float | None = None,
    directions: Callable[[], tuple[str, ...]] | None = None,
):
    """Yield (samples so far, statistics) chunk by chunk in seed order, mapping `mapper.wave` chunks at a time;
    `directions()` says which directions the next wave still needs. Chunk c of `tag` is the same whatever
    the mapper, so where a caller stops does not depend on it."""
    done = 0
    started = logged = time.perf_counter()
    while done < samples:
        wanted = directions() if directions else DIRECTIONS
        tasks = []
        for first in range(done, min(samples, done + mapper.wave * CHUNK), CHUNK):
            tasks.append(
                ChunkTask(
                    process, sigma, epsilon, min(CHUNK, samples - first), chunk_seed(tag, first // CHUNK), wanted, bound
                )
            )
        for task, statistics in zip(tasks, mapper.map(chunk_statistics, tasks)):
            done += task.size
            yield done, dict(zip(task.directions, statistics))
        if time.perf_counter() - logged > 30:
            logged = time.perf_counter()
            log.info("  %d of at most %d samples (%.0f samples/s)", done, samples, done / (logged - started))


def estimate_delta(
    process: MinSepProcess, sigma: float, epsilon: float, samples: int, tag: tuple[int, ...], mapper: ChunkMap
) -> float:
    """Monte Carlo delta(epsilon) on `samples` samples, the larger of both directions."""
    _, estimate = _estimate_passes(process, sigma, epsilon, samples, tag, mapper, 1.0, early=False)
    assert estimate is not None  # without early stopping, the estimate runs over every sample
    return estimate


def _estimate_passes(
    process: MinSepProcess,
    sigma: float,
    epsilon: float,
    samples: int,
    tag: tuple[int, ...],
    mapper: ChunkMap,
    target: float,
    early: bool = True,
) -> tuple[bool, float | None]:
    """Whether delta(epsilon) <= target by the estimate, stopping as soon as three standard errors (plus
    1 / samples, for when no term was seen yet) decide (if `early`); with the full-sample estimate when
    it did not stop. Only the ladder's place rests on this, never the guarantee."""
    sums = {under: np.zeros(2) for under in DIRECTIONS}
    for done, statistics in stream_chunks(process, sigma, epsilon, samples, tag, mapper):
        for under, values in statistics.items():
            sums[under] += values[:2]
        means = {under: total[0] / done for under, total in sums.items()}
        errors = {
            under: math.sqrt(max(total[1] / done - means[under] ** 2, 0.0) / done) for under, total in sums.items()
        }
        if not early or done == samples:
            continue
        above = any(means[u] - 3 * errors[u] > target for u in DIRECTIONS)
        if above or all(means[u] + 3 * errors[u] + 1 / done < target for u in DIRECTIONS):
            decided = not above
            log.info(
                "estimate at sigma %.6g, epsilon %.6g: delta %s %.3g after %d samples",
                sigma,
                epsilon,
                "<" if decided else ">",
                target,
                done,
            )
            return decided, None
    estimate = float(max(means.values()))
    log.info("estimate at sigma %.6g, epsilon %.6g: delta %.4g from %d samples", sigma, epsilon, estimate, samples)
    return estimate <= target, estimate


def verify(
    process: MinSepProcess,
    sigma: float,
    epsilon: float,
    samples: int,
    tag: tuple[int, ...],
    mapper: ChunkMap,
    mechanism_delta: float,
    level: float,
) -> tuple[bool, int]:
    """(passed, samples drawn): whether betting tests in both directions reject delta(epsilon) >= delta*
    at `level` within `samples` samples. Gives up early (fails) once the evidence for delta > delta*
    reaches 1 / GIVE_UP_LEVEL, or when, past half the samples, the log wealth growing at its rate so far
    would not reach the threshold in time; a direction that has rejected stops drawing."""
    wealth = {under: np.zeros(2 * len(BETS)) for under in DIRECTIONS}
    rejected: set[str] = set()
    threshold = math.log(1 / level)
    done = 0
    for done, statistics in stream_chunks(
        process,
        sigma,
        epsilon,
        samples,
        tag,
        mapper,
        mechanism_delta,
        lambda: tuple(u for u in DIRECTIONS if u not in rejected),
    ):
        for under, values in statistics.items():
            if under in rejected:
                continue
            wealth[under] += values[2:]
            private, not_private = log_wealth(wealth[under])
            if not_private >= math.log(1 / GIVE_UP_LEVEL):
                log.info(
                    "verification at sigma %.6g, epsilon %.6g: failed, delta > %.3g in direction %s after %d samples",
                    sigma,
                    epsilon,
                    mechanism_delta,
                    under,
                    done,
                )
                return False, done
            if private >= threshold:
                rejected.add(under)
            elif 2 * done >= samples and private + (samples - done) * max(private, 0.0) / done < threshold:
                log.info(
                    "verification at sigma %.6g, epsilon %.6g: failed, direction %s would not pass within %d "
                    "samples at its rate so far (%d drawn)",
                    sigma,
                    epsilon,
                    under,
                    samples,
                    done,
                )
                return False, done
        if len(rejected) == len(DIRECTIONS):
            log.info(
                "verification at sigma %.6g, epsilon %.6g: passed at level %.3g after %d samples",
                sigma,
                epsilon,
                level,
                done,
            )
            return True, done
    log.info("verification at sigma %.6g, epsilon %.6g: failed, no decision within %d samples", sigma, epsilon, done)
    return False, done


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
    delta*, as Theorem A.1 needs. Verification by betting tests in both directions."""
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
    result states (epsilon, delta*) with that failure probability."""
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
) -> MinSepRelease:
    """Algorithm 5 over one parameter; `sigma_epsilon(value)` is the (sigma, epsilon) a candidate value
    claims, `fallback_at(delta*)` the formally valid value, and the search starts at `low` times it."""
    mechanism_delta, failure = release_deltas(delta)
    fewest = samples_to_reject_on_zeros(mechanism_delta, rung_level(failure, 0))
    samples = samples or default_samples(delta)
    if samples < fewest:
        raise InputError(
            f"{samples} samples cannot verify delta {delta:g}: even a mechanism with delta 0 needs "
            f"{fewest} (the default budget is {default_samples(delta)})"
        )
    estimate_samples = max(math.ceil(ESTIMATE_SAMPLES / mechanism_delta), ESTIMATE_MIN_SAMPLES)
    fallback = fallback_at(mechanism_delta)
    with task_map(workers, remote) as mapper:
        released, estimate, ladder, outcomes, used = _estimate_verify_release(
            lambda value, target, count, early=True: _estimate_passes(
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
        {"process": dataclasses.asdict(process), **target, "delta": delta, "samples": samples},
        {"seed": seed, "released": released, "verified": released < fallback},
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
    )


# --- the attempts ledger ------------------------------------------------------------------------


def attempts_ledger() -> str:
    """Where every Monte Carlo calibration is recorded: $MADP_ATTEMPTS_LEDGER, else ~/.madp/."""
    return os.environ.get("MADP_ATTEMPTS_LEDGER") or os.path.join(
        os.path.expanduser("~"), ".madp", "monte-carlo-attempts.jsonl"
    )


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
        log.warning(
            "this Monte Carlo calibration ran %d times before (%s): choosing among runs multiplies the "
            "failure probability by their number",
            earlier,
            path,
        )
    return earlier + 1
