"""Monte Carlo accounting kernels for BandMF with (multi-attribution) b-min-sep Poisson sampling.

The worst case of one user is the matrix mechanism y = C x + z, z ~ N(0, sigma^2 I) (P), against
y = z (Q). Under P the user is available at step i unless it participated in the previous b - 1
steps; when available it contributes x_i ~ Binomial(k_u, p) records (k_u = 1: Alg. 1 of the
b-min-sep paper; k_u > 1: Sec. 6.2). The likelihood ratio P(y)/Q(y) is f_1 of the backward
recursion (eq. (1), extended to Binomial counts):

    f_i = Binom(0) f_{i+1} + sum_{j>=1} Binom(j) r_i(j) f_{i+b},   f_i = 1 for i > T,
    r_i(j) = exp((j <c_i, y_i..y_{i+b-1}> - j^2 ||c_i||^2 / 2) / sigma^2),

with c_i the nonzero part of column i of C. The kernels are compiled (numba) and run one sample
at a time, fusing its draws (`accounting/random_streams.py`), its dots, its weights and the
recursion, in linear space with rescaling where that is exact, else in log space.
Estimate-verify-release (`accounting/evr.py`) turns these estimates into a formal guarantee.

One module over ~350 lines on purpose: the compiled kernels below share one state layout (`_Kernel`)
and one sample's order of draws; the tests compare them against exact enumeration as a unit.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import numpy as np
from numba import njit
from scipy.stats import binom

from madp.accounting.mechanisms import check_contributions, check_min_sep, check_probability, check_steps
from madp.accounting.random_streams import (
    check_seed,
    failures_before_success,
    fill_standard_normals,
    seed_stream,
    standard_normals,
    uniform,
)
from madp.core.errors import InputError

DIRECTIONS = ("P", "Q")


@dataclasses.dataclass(frozen=True)
class MinSepProcess:
    """One user's participation process: T steps, min-sep b, probability p, up to k_u records."""

    steps: int
    min_sep: int
    sampling_prob: float
    max_contributions: int
    coefficients: tuple[float, ...]  # bands of C, len <= min_sep

    def __post_init__(self) -> None:
        check_steps(self.steps)
        check_min_sep(self.min_sep, len(self.coefficients))
        check_probability("--sampling-prob", self.sampling_prob)
        check_contributions(self.max_contributions)
        if min(self.coefficients, default=0.0) < 0:
            raise InputError(
                f"b-min-sep amplification (Theorem 6.1 of the b-min-sep paper) needs a non-negative "
                f"strategy matrix C; these bands have negative entries {self.coefficients}: use "
                f"--strategy sqrt, or account without amplification"
            )

    @property
    def count_log_probs(self) -> np.ndarray:
        """log Binomial(j; k_u, p) for j = 0..k_u."""
        return binom.logpmf(np.arange(self.max_contributions + 1), self.max_contributions, self.sampling_prob)


class _Kernel(NamedTuple):
    """What the compiled kernels need of (process, sigma), in the recursion's terms."""

    coefficients: np.ndarray  # c_0..c_(bands-1)
    overlaps: np.ndarray  # [delta + bands - 1] = sum_m c_m c_(m - delta), |delta| < bands
    inv_sigma: float
    min_sep: int
    stay: float  # s = Binom(0)
    log_stay: float
    weight_table: np.ndarray  # [j - 1, i] = Binom(j) e^(-j^2 h_i), h_i = ||c_i||^2 / (2 sigma^2)
    log_weight_table: np.ndarray
    count_cdf: np.ndarray  # P(records <= j | records >= 1), j = 1..k_u
    linear: bool  # whether s^b allows the linear-space recursion at all


def _kernel(process: MinSepProcess, noise_multiplier: float) -> _Kernel:
    if not noise_multiplier > 0:
        raise InputError(f"the noise multiplier must be positive, got {noise_multiplier}")
    coefficients = np.asarray(process.coefficients, dtype=np.float64)
    steps = process.steps
    # ||c_i||^2 counts only the bands before the horizon
    norms = np.cumsum(coefficients**2)[np.minimum(len(coefficients), steps - np.arange(steps)) - 1]
    counts = np.arange(1, process.max_contributions + 1)[:, None]
    log_probs = process.count_log_probs
    log_table = log_probs[1:, None] - counts**2 * norms[None, :] / (2 * noise_multiplier**2)
    taking = np.exp(log_probs[1:])
    count_cdf = np.cumsum(taking) / taking.sum()
    count_cdf[-1] = 1.0  # uniforms are < 1: never more than k_u records
    return _Kernel(
        coefficients,
        np.correlate(coefficients, coefficients, "full"),
        1.0 / noise_multiplier,
        process.min_sep,
        float(np.exp(log_probs[0])),
        float(log_probs[0]),
        np.exp(log_table),
        log_table,
        count_cdf,
        bool(process.min_sep * -log_probs[0] <= _LINEAR_SPAN),
    )


# The linear-space recursion rescales f every _CHECK_STEPS steps when it left [1 / _RESCALE_ABOVE,
# _RESCALE_ABOVE]. It runs when b log(1/s) <= _LINEAR_SPAN and k_u max_i d_i <= _LINEAR_EXPONENT
# (d_i = <c_i, y> / sigma^2): then f_i / f_(i+1) = s + W_i f_(i+b) / f_(i+1) <= 1 + e^(50 + 20), so in
# 8 steps f stays below 1e30 e^560 < 1e274; f stays above 1e-30 s^8 >= 1e-100, so a term lost to underflow
# (W_i f_(i+b) < e^50 2.2e-308) is below 1e-170 of the term s f_(i+1) kept beside it.
# Otherwise the sample's direction takes the log-space recursion (in practice: sigma < ~0.2, or p ~ 1).
_CHECK_STEPS = 8
_RESCALE_ABOVE = 1e30
_LINEAR_SPAN = 20.0
_LINEAR_EXPONENT = 50.0
# exp(x) = 2^k e^r, k = round(x / ln 2), |r| <= ln(2) / 2, e^r by its Taylor series to r^11 (relative
# error < 1e-14): unlike libm's exp, this loop vectorizes.
_LOG2_E = 1.4426950408889634
_LN2_HIGH = 0.6931471803691238  # ln 2 in two parts, so k ln 2 is exact to 2^-80 for |k| < 1100
_LN2_LOW = 1.9082149292705877e-10
_TAYLOR = tuple(1.0 / math.factorial(j) for j in range(11, -1, -1))


@njit(cache=True, fastmath={"contract"})
def _dots(z, kernel, d):
    """d_i = <c_i, y_i..y_(i+bands-1)> / sigma^2 from z = y / sigma (z zero past the horizon)."""
    steps = d.shape[0]
    first = kernel.coefficients[0] * kernel.inv_sigma
    for i in range(steps):
        d[i] = first * z[i]
    for lag in range(1, kernel.coefficients.shape[0]):
        band = kernel.coefficients[lag] * kernel.inv_sigma
        for i in range(steps):
            d[i] += band * z[i + lag]


@njit(cache=True, fastmath={"contract"})
def _weights(d, kernel, bits, out):
    """W_i = sum_j Binom(j) e^(j d_i - j^2 h_i) (every d_i <= _LINEAR_EXPONENT / k_u):
    e^(d_i) by the vectorizable exp above, then Horner's rule in it."""
    powers = bits.view(np.float64)
    for i in range(d.shape[0]):
        x = max(d[i], -700.0)  # e^-700 instead of less: negligible next to s f_(i+1)
        k = math.floor(x * _LOG2_E + 0.5)
        r = (x - k * _LN2_HIGH) - k * _LN2_LOW
        series = 0.0
        for coefficient in _TAYLOR:
            series = series * r + coefficient
        bits[i] = (np.int64(k) + 1023) << 52  # the float 2^k
        out[i] = series
    table = kernel.weight_table
    top = table.shape[0] - 1
    for i in range(d.shape[0]):
        exponential = out[i] * powers[i]
        weight = table[top, i]
        for count in range(top - 1, -1, -1):
            weight = weight * exponential + table[count, i]
        out[i] = weight * exponential


@njit(cache=True, fastmath={"contract"})
def _log_f_linear(w_a, w_b, kernel, f_a, f_b):
    """log f_0 of f_i = s f_(i+1) + W_i f_(i+b), f_i = 1 past the horizon, in linear space, for two weight
    sequences side by side: each step waits on the one before, so two chains cost about what one does."""
    steps, gap = w_a.shape[0], kernel.min_sep
    f_a[steps : steps + gap] = 1.0
    f_b[steps : steps + gap] = 1.0
    log_scale_a = log_scale_b = 0.0
    current_a = current_b = 1.0
    i = steps - 1
    while i >= 0:
        stop = max(i - _CHECK_STEPS, -1)
        for j in range(i, stop, -1):
            current_a = kernel.stay * current_a + w_a[j] * f_a[j + gap]
            current_b = kernel.stay * current_b + w_b[j] * f_b[j + gap]
            f_a[j] = current_a
            f_b[j] = current_b
        i = stop
        if not 1.0 / _RESCALE_ABOVE <= min(current_a, current_b) <= max(current_a, current_b) <= _RESCALE_ABOVE:
            for j in range(i + 1, i + 1 + gap):  # the f that later steps read
                f_a[j] /= current_a
                f_b[j] /= current_b
            log_scale_a += math.log(current_a)
            log_scale_b += math.log(current_b)
            current_a = current_b = 1.0
    return math.log(current_a) + log_scale_a, math.log(current_b) + log_scale_b


@njit(cache=True)
def _log_f_log_space(d, kernel, log_f):
    """The same recursion in log space, for weights or spans the linear one cannot hold."""
    steps, gap = d.shape[0], kernel.min_sep
    log_f[steps : steps + gap] = 0.0
    table = kernel.log_weight_table
    for i in range(steps - 1, -1, -1):
        log_weight = -math.inf
        for count in range(table.shape[0]):
            log_weight = np.logaddexp(log_weight, table[count, i] + (count + 1) * d[i])
        log_f[i] = np.logaddexp(kernel.log_stay + log_f[i + 1], log_weight + log_f[i + gap])
    return log_f[0]


@njit(inline="always", cache=True)
def _linear_holds(d, kernel):
    return kernel.linear and kernel.weight_table.shape[0] * d.max() <= _LINEAR_EXPONENT


@njit(cache=True)
def _log_f_rows(d, wanted, kernel, weights, bits, f, out):
    """out[row] = log f_0 from the dots d[row] for each `wanted` row (P, Q): in linear space where that is
    exact, the two rows side by side, else in log space."""
    linear = (wanted[0] and _linear_holds(d[0], kernel), wanted[1] and _linear_holds(d[1], kernel))
    for row in range(2):
        if linear[row]:
            _weights(d[row], kernel, bits, weights[row])
        elif wanted[row]:
            out[row] = _log_f_log_space(d[row], kernel, f[row])
    if linear[0] or linear[1]:
        first, second = _log_f_linear(
            weights[0 if linear[0] else 1], weights[1 if linear[1] else 0], kernel, f[0], f[1]
        )  # a lone linear row runs twice, at no extra cost
        if linear[0]:
            out[0] = first
        if linear[1]:
            out[1] = second


@njit(cache=True)
def _participations(state, kernel, steps, starts, counts):
    """One sample's participations by waiting times: at each available step the user takes part with
    probability 1 - s, so the wait is geometric; then it is unavailable for b - 1 steps; its record
    count is Binomial(k_u, p) given >= 1. Fills `starts` and `counts`, returns how many."""
    taken = 0
    step = failures_before_success(state, kernel.log_stay, steps)
    while step < steps:
        starts[taken] = step
        counts[taken] = 1 + np.searchsorted(kernel.count_cdf, uniform(state), side="right")
        taken += 1
        step += kernel.min_sep + failures_before_success(state, kernel.log_stay, steps)
    return taken


@njit(cache=True, fastmath={"contract"})
def _add_participation(start, count, kernel, d):
    """Add to the dots d what `count` records at step `start` add: C x / sigma in the outputs over sigma
    (rows start..start + bands - 1, before the horizon) moves d_(start + delta) by count / sigma^2 times
    sum_m c_m c_(m - delta), the bands' autocorrelation, or its truncation at the horizon."""
    bands, steps = kernel.coefficients.shape[0], d.shape[0]
    scale = count * kernel.inv_sigma**2
    if start + bands <= steps:
        for i in range(max(0, start - bands + 1), start + bands):
            d[i] += scale * kernel.overlaps[i - start + bands - 1]
        return
    c = kernel.coefficients
    for i in range(max(0, start - bands + 1), steps):
        extra = 0.0
        for row in range(max(start, i), min(start + bands, i + bands, steps)):
            extra += c[row - i] * c[row - start]
        d[i] += scale * extra


_NOISE, _PARTICIPATIONS = 0, 1  # the streams of a sample


@njit(cache=True)
def _sample_log_ratios(kernel, seed, samples, steps, with_p, with_q):
    """[log P/Q under P, under Q] of samples 0..samples - 1 (NaN in a direction not drawn)."""
    ratios = np.full((2, samples), np.nan)
    z = np.zeros(steps + kernel.coefficients.shape[0])  # Q's outputs over sigma, zero past the horizon
    dots, weights = np.empty((2, steps)), np.empty((2, steps))  # rows: P, Q
    bits, f = np.empty(steps, np.int64), np.empty((2, steps + kernel.min_sep))
    starts, counts = np.empty(steps, np.int64), np.empty(steps, np.int64)
    wanted = np.array([with_p, with_q])
    state = np.empty(4, np.uint64)
    for sample in range(samples):
        seed_stream(state, seed, sample, _NOISE)
        fill_standard_normals(z[:steps], state)
        _dots(z, kernel, dots[1])
        if with_p:
            seed_stream(state, seed, sample, _PARTICIPATIONS)
            dots[0] = dots[1]
            for m in range(_participations(state, kernel, steps, starts, counts)):
                _add_participation(starts[m], counts[m], kernel, dots[0])
        _log_f_rows(dots, wanted, kernel, weights, bits, f, ratios[:, sample])
    return ratios


@njit(cache=True)
def _log_ratios_of_outputs(kernel, outputs_over_sigma):
    steps, samples = outputs_over_sigma.shape
    z = np.zeros(steps + kernel.coefficients.shape[0])
    dots, weights = np.empty((2, steps)), np.empty((2, steps))
    bits, f = np.empty(steps, np.int64), np.empty((2, steps + kernel.min_sep))
    wanted = np.array([True, False])
    ratios = np.empty((2, samples))
    for sample in range(samples):
        z[:steps] = outputs_over_sigma[:, sample]
        _dots(z, kernel, dots[0])
        _log_f_rows(dots, wanted, kernel, weights, bits, f, ratios[:, sample])
    return ratios[0]


@njit(cache=True)
def _sampled_participations(kernel, seed, samples, steps):
    starts, counts = np.empty(steps, np.int64), np.empty(steps, np.int64)
    found_steps, found_samples, found_counts = [], [], []
    state = np.empty(4, np.uint64)
    for sample in range(samples):
        seed_stream(state, seed, sample, _PARTICIPATIONS)
        for m in range(_participations(state, kernel, steps, starts, counts)):
            found_steps.append(starts[m])
            found_samples.append(sample)
            found_counts.append(counts[m])
    return np.array(found_steps, np.int64), np.array(found_samples, np.int64), np.array(found_counts, np.int64)


def log_likelihood_ratio(process: MinSepProcess, noise_multiplier: float, outputs: np.ndarray) -> np.ndarray:
    """log P(y)/Q(y) per sample; `outputs` is T x samples (one column per sample)."""
    outputs = np.asarray(outputs, dtype=np.float64)
    if outputs.ndim != 2 or outputs.shape[0] != process.steps:
        raise ValueError(f"outputs must be {process.steps} x samples, got shape {outputs.shape}")
    return _log_ratios_of_outputs(_kernel(process, noise_multiplier), outputs / noise_multiplier)


def sample_log_ratios(
    process: MinSepProcess, noise_multiplier: float, samples: int, seed: int, directions: tuple[str, ...] = DIRECTIONS
) -> np.ndarray:
    """log P/Q at `samples` outputs drawn under each of `directions` ("P": y = C x + sigma z, "Q": y = sigma z),
    one row per direction; reproducible from `seed`.

    The directions share the noise z (common random numbers): each row is an independent sample of its own
    distribution, which is all a test of that direction needs. Sample n draws z from stream (seed, n, 0)
    and its participations from (seed, n, 1), so a direction's row does not depend on which other
    directions are drawn with it.
    """
    if not directions or not set(directions) <= set(DIRECTIONS):
        raise ValueError(f"directions must be some of {DIRECTIONS}, got {directions!r}")
    ratios = _sample_log_ratios(
        _kernel(process, noise_multiplier),
        check_seed(seed),
        samples,
        process.steps,
        "P" in directions,
        "Q" in directions,
    )[[DIRECTIONS.index(under) for under in directions]]
    if not np.isfinite(ratios).all():  # cannot happen: the linear path runs only where it is exact
        raise FloatingPointError(f"non-finite privacy loss for {process} at sigma {noise_multiplier}")
    return ratios


def sampled_participations(process: MinSepProcess, samples: int, seed: int) -> tuple[np.ndarray, ...]:
    """(step, sample, records) of every participation that `sample_log_ratios` draws under P."""
    return _sampled_participations(_kernel(process, 1.0), check_seed(seed), samples, process.steps)


def sampled_noise(process: MinSepProcess, samples: int, seed: int) -> np.ndarray:
    """The standard normals z (T x samples) that `sample_log_ratios` draws: Q's outputs are sigma z."""
    return np.column_stack([standard_normals(seed, sample, _NOISE, process.steps) for sample in range(samples)])


def hockey_stick_terms(log_ratios: np.ndarray, epsilon: float, under: str) -> np.ndarray:
    """Per-sample terms whose mean is delta(epsilon) in one direction.

    Under P: delta(P || Q) = E_P[(1 - e^(eps - L))_+]; under Q: delta(Q || P) = E_Q[(1 - e^(eps + L))_+],
    with L = log P/Q.
    """
    exponent = epsilon - log_ratios if under == "P" else epsilon + log_ratios
    return np.clip(-np.expm1(exponent), 0.0, None)


def hockey_stick(log_ratios: np.ndarray, epsilon: float, under: str) -> tuple[float, float]:
    """Estimate and standard error of delta(epsilon) in one direction."""
    terms = hockey_stick_terms(log_ratios, epsilon, under)
    return float(terms.mean()), float(terms.std(ddof=1) / np.sqrt(len(terms)))
