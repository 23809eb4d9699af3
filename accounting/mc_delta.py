"""Monte Carlo delta(epsilon) of a b-min-sep process, drawn chunk by chunk over workers: estimates,
and verifications by betting (`accounting/betting.py`). A chunk's samples depend only on its seed,
which depends only on its tag and place, so every mapper (this process, a pool, a Beam cluster)
draws the same samples and a sequential test stops at the same place.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor

import numpy as np

from madp.accounting.betting import BETS, log_wealth, log_wealth_steps
from madp.accounting.monte_carlo import (
    DIRECTIONS,
    DeltaReduction,
    MinSepProcess,
    delta_reduction,
    reduced_terms,
    sample_log_ratios,
)
from madp.core.errors import OptionError

log = logging.getLogger("madp.accounting")

CHUNK = 8192  # samples per task: the unit of parallelism, of seeding and of a test's stopping times
# A verification gives up (fails, which is always safe) when the evidence that delta > delta* reaches
# 1 / GIVE_UP_LEVEL, or after its sample budget.
GIVE_UP_LEVEL = 1e-3


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
    tail: int = 0  # how many of the most extreme log ratios to return per direction
    reduce: bool = True  # False: plain terms on P's and Q's own samples (benchmarks compare the two)


def given_one(task: ChunkTask) -> bool:
    """Whether the task's P samples are drawn given >= 1 participation (`DeltaReduction`)."""
    return _reductions(task.process, task.epsilon, task.reduce)["P"].at_least_one


def chunk_statistics(task: ChunkTask, ratios: np.ndarray | None = None) -> tuple[list[list[float]], list[list[float]]]:
    """Per direction: [sum of the reduced terms X, sum of their squares, *log wealth steps], and its `tail`
    most extreme log ratios (runs in workers). X is the hockey-stick term over the direction's span, on P's
    samples given >= 1 participation where that pays (`madp.accounting.monte_carlo.DeltaReduction`); the
    tests bet against E[X] >= bound / weight. `ratios`: the task's log ratios where a GPU drew them
    (`madp.accounting.monte_carlo_cuda.cuda_task_map`), else drawn here."""
    reductions = _reductions(task.process, task.epsilon, task.reduce)
    if ratios is None:
        at_least_one = reductions["P"].at_least_one
        ratios = sample_log_ratios(task.process, task.sigma, task.size, task.seed, task.directions, at_least_one)
    statistics, tails = [], []
    for under, row in zip(task.directions, ratios):
        reduction = reductions[under]
        terms = reduced_terms(row, task.epsilon, under, reduction)
        steps = [] if task.bound is None else log_wealth_steps(terms, task.bound / reduction.weight).tolist()
        statistics.append([float(terms.sum()), float(np.square(terms).sum()), *steps])
        # P's terms grow with L, Q's fall with it: the largest L under P, the smallest under Q
        extreme = np.sort(row if under == "Q" else -row)[: task.tail] if task.tail else row[:0]
        tails.append((extreme if under == "Q" else -extreme).tolist())
    return statistics, tails


# A chunk drawn for an estimate keeps its TAIL most extreme log ratios per direction. They do not depend on
# epsilon, so an estimate at another epsilon and the same sigma (`madp epsilon`'s search) computes that
# chunk's sums from them without drawing it again, whenever every sample outside the tail has term 0 there.
TAIL = 64


def _reductions(process: MinSepProcess, epsilon: float, reduce: bool) -> dict[str, DeltaReduction]:
    """Each direction's DeltaReduction at `epsilon`, or none (weight and span 1, P as it is) without `reduce`."""
    return {u: delta_reduction(process, epsilon, u) if reduce else DeltaReduction(1.0, 1.0) for u in DIRECTIONS}


def _tail_sums(
    tail: np.ndarray, size: int, epsilon: float, under: str, reduction: DeltaReduction
) -> list[float] | None:
    """A chunk's [sum of X, sum of X^2] at `epsilon` from its tail, or None when the tail does not hold every
    sample whose term is nonzero there."""
    if len(tail) < size and not (tail.min() <= epsilon if under == "P" else tail.max() >= -epsilon):
        return None
    terms = reduced_terms(tail, epsilon, under, reduction)
    return [float(terms.sum()), float(np.square(terms).sum())]


def drawn_directions(process: MinSepProcess, epsilon: float, bound: float, reduce: bool = True) -> tuple[str, ...]:
    """The directions whose delta(epsilon) <= `bound` is not certified without samples (`DeltaReduction`)."""
    if not reduce:
        return DIRECTIONS
    return tuple(u for u in DIRECTIONS if not delta_reduction(process, epsilon, u).certified(bound))


@dataclasses.dataclass(frozen=True)
class ChunkMap:
    """`map` over chunk tasks, `wave` tasks at a time (a sequential test looks after every wave)."""

    map: Callable
    wave: int
    # (process, sigma, chunk seed, size, P given >= 1, direction) -> the chunk's TAIL most extreme log ratios
    tails: dict = dataclasses.field(default_factory=dict)


# Opens a `map(fn, tasks)` on a cluster for a whole run, e.g. madp.beam.monte_carlo.BeamTaskMap
RemoteMap = Callable[[], contextlib.AbstractContextManager[Callable]]


@contextlib.contextmanager
def task_map(workers: int, remote: RemoteMap | None = None):
    """A `ChunkMap`: in this process, in one pool of `workers` processes kept for a whole run, or on
    the cluster `remote` opens (64 tasks a wave)."""
    if workers < 1:
        raise OptionError("{workers} must be at least 1, got {0}", workers)
    if remote is not None:
        with remote() as mapper:
            yield ChunkMap(mapper, 64)
    elif workers == 1:
        yield ChunkMap(map, 1)
    else:
        with ProcessPoolExecutor(workers) as pool:
            yield ChunkMap(pool.map, 2 * workers)


def chunk_seed(tag: tuple[int, ...], chunk: int) -> int:
    """64 bits: a verification of ~1e4 chunks would repeat a 32-bit seed with probability ~1%, and a
    repeated chunk is no longer an independent sample."""
    return int(np.random.SeedSequence([*tag, chunk]).generate_state(1, np.uint64)[0])


def stream_chunks(
    process: MinSepProcess,
    sigma: float,
    epsilon: float,
    samples: int,
    tag: tuple[int, ...],
    mapper: ChunkMap,
    bound: float | None = None,
    directions: Callable[[], tuple[str, ...]] | None = None,
    reduce: bool = True,
):
    """Yield (samples so far, statistics) chunk by chunk in seed order, mapping `mapper.wave` chunks at a time;
    `directions()` says which directions the next wave still needs. Chunk c of `tag` is the same whatever
    the mapper, so where a caller stops does not depend on it. Without a `bound` (estimates, with `reduce`),
    chunks come from the mapper's tails where they can (`TAIL`), else are drawn and their tails kept."""
    done = 0
    started = logged = time.perf_counter()
    reductions = _reductions(process, epsilon, reduce)
    given_one = reductions["P"].at_least_one
    while done < samples:
        wanted = directions() if directions else DIRECTIONS
        tasks: list[ChunkTask] = []
        known: dict[int, list] = {}
        for first in range(done, min(samples, done + mapper.wave * CHUNK), CHUNK):
            task = ChunkTask(
                process,
                sigma,
                epsilon,
                min(CHUNK, samples - first),
                chunk_seed(tag, first // CHUNK),
                wanted,
                bound,
                TAIL if bound is None and reduce else 0,
                reduce,
            )
            if task.tail:
                tails = [mapper.tails.get((process, sigma, task.seed, task.size, given_one, under)) for under in wanted]
                sums = [
                    None if t is None else _tail_sums(t, task.size, epsilon, u, reductions[u])
                    for t, u in zip(tails, wanted)
                ]
                if all(s is not None for s in sums):
                    known[len(tasks)] = sums
            tasks.append(task)
        drawn = iter(mapper.map(chunk_statistics, [t for n, t in enumerate(tasks) if n not in known]))
        for n, task in enumerate(tasks):
            if n in known:
                statistics = known[n]
            else:
                statistics, tails = next(drawn)
                for under, tail in zip(task.directions, tails):
                    if tail:
                        mapper.tails[(process, sigma, task.seed, task.size, given_one, under)] = np.asarray(tail)
            done += task.size
            yield done, dict(zip(task.directions, statistics))
        if time.perf_counter() - logged > 30:
            logged = time.perf_counter()
            log.info("  %d of at most %d samples (%.0f samples/s)", done, samples, done / (logged - started))


def estimate_delta(
    process: MinSepProcess, sigma: float, epsilon: float, samples: int, tag: tuple[int, ...], mapper: ChunkMap
) -> float:
    """Monte Carlo delta(epsilon) on `samples` samples, the larger of both directions."""
    _, estimate = estimate_passes(process, sigma, epsilon, samples, tag, mapper, 1.0, early=False)
    assert estimate is not None  # without early stopping, the estimate runs over every sample
    return estimate


def estimate_passes(
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
    drawn = drawn_directions(process, epsilon, 0.0)  # a direction with delta = 0 exactly needs no estimate
    weights = {under: delta_reduction(process, epsilon, under).weight for under in drawn}
    sums = {under: np.zeros(2) for under in drawn}
    means = {under: 0.0 for under in DIRECTIONS}
    for done, statistics in stream_chunks(process, sigma, epsilon, samples, tag, mapper, directions=lambda: drawn):
        for under, values in statistics.items():
            sums[under] += values[:2]
        means = {under: weights[under] * total[0] / done for under, total in sums.items()}
        errors = {
            under: weights[under] * math.sqrt(max(total[1] / done - (total[0] / done) ** 2, 0.0) / done)
            for under, total in sums.items()
        }
        if not early or done == samples:
            continue
        above = any(means[u] - 3 * errors[u] > target for u in drawn)
        if above or all(means[u] + 3 * errors[u] + weights[u] / done < target for u in drawn):
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


def _failure(
    under: str, private: float, not_private: float, done: int, samples: int, threshold: float, mechanism_delta: float
) -> str | None:
    """Why the test of direction `under` fails after `done` of `samples` samples, at log wealths `private`
    (for delta <= delta*) and `not_private`, or None while it may pass: the evidence for delta > delta*
    reached 1 / GIVE_UP_LEVEL, or, past half the samples, the log wealth growing at its rate so far would
    not reach `threshold` in time."""
    if not_private >= math.log(1 / GIVE_UP_LEVEL):
        return f"failed, delta > {mechanism_delta:.3g} in direction {under} after {done} samples"
    if (
        private < threshold
        and 2 * done >= samples
        and private + (samples - done) * max(private, 0.0) / done < threshold
    ):
        return f"failed, direction {under} would not pass within {samples} samples at its rate so far ({done} drawn)"
    return None


def verify(
    process: MinSepProcess,
    sigma: float,
    epsilon: float,
    samples: int,
    tag: tuple[int, ...],
    mapper: ChunkMap,
    mechanism_delta: float,
    level: float,
    reduce: bool = True,
) -> tuple[bool, int]:
    """(passed, samples drawn): whether betting tests in both directions reject delta(epsilon) >= delta*
    at `level` within `samples` samples. Gives up early (fails) once the evidence for delta > delta*
    reaches 1 / GIVE_UP_LEVEL, or when, past half the samples, the log wealth growing at its rate so far
    would not reach the threshold in time; a direction that has rejected stops drawing. With `reduce`, the
    tests run on DeltaReduction's terms, and a direction it certifies (delta <= weight <= delta*) counts
    as rejected before any sample."""
    wealth = {under: np.zeros(2 * len(BETS)) for under in DIRECTIONS}
    rejected = set(DIRECTIONS) - set(drawn_directions(process, epsilon, mechanism_delta, reduce))
    if rejected:
        log.info(
            "verification at sigma %.6g, epsilon %.6g: direction %s certified without samples (delta <= %.3g)",
            sigma,
            epsilon,
            "".join(sorted(rejected)),
            mechanism_delta,
        )
    if len(rejected) == len(DIRECTIONS):
        return True, 0
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
        reduce,
    ):
        for under, values in statistics.items():
            if under in rejected:
                continue
            wealth[under] += values[2:]
            private, not_private = log_wealth(wealth[under])
            failure = _failure(under, private, not_private, done, samples, threshold, mechanism_delta)
            if failure is not None:
                log.info("verification at sigma %.6g, epsilon %.6g: %s", sigma, epsilon, failure)
                return False, done
            if private >= threshold:
                rejected.add(under)
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
