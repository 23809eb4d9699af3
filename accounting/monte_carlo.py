"""Monte Carlo accounting kernels for BandMF with (multi-attribution) b-min-sep Poisson sampling.

The worst case of one user is the matrix mechanism y = C x + z, z ~ N(0, sigma^2 I) (P), against
y = z (Q). Under P the user is available at step i unless it participated in the previous b - 1
steps; when available it contributes x_i ~ Binomial(k_u, p) records (k_u = 1: Alg. 1 of the
b-min-sep paper; k_u > 1: Sec. 6.2). The likelihood ratio P(y)/Q(y) is f_1 of the backward
recursion (eq. (1), extended to Binomial counts):

    f_i = Binom(0) f_{i+1} + sum_{j>=1} Binom(j) r_i(j) f_{i+b},   f_i = 1 for i > T,
    r_i(j) = exp((j <c_i, y_i..y_{i+b-1}> - j^2 ||c_i||^2 / 2) / sigma^2),

with c_i the nonzero part of column i of C. The kernels are compiled (numba) and run a batch of
samples at a time: their draws (`accounting/random_streams.py`), their dots (directly, or by FFT for
many bands), then per sample its participations and weights, and the recursions of the batch side by
side, in linear space with rescaling where that is exact, else in log space. `DeltaReduction` bounds
delta by terms with a smaller range or on fewer samples. Estimate-verify-release
(`accounting/evr.py`) turns these estimates into a formal guarantee.

One module over ~500 lines on purpose: the compiled kernels below share one state layout (`_Kernel`)
and one sample's order of draws; the tests compare them against exact enumeration as a unit.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import numpy as np
import scipy.fft
from llvmlite import ir
from numba import int32, int64, njit, types
from numba.extending import intrinsic
from scipy.stats import binom

from madp.accounting.mechanisms import check_contributions, check_min_sep, check_probability, check_steps
from madp.accounting.random_streams import (
    check_seed,
    failures_before_success,
    failures_before_success_below,
    fill_standard_normals,
    seed_stream,
    standard_normals,
    uniform,
)
from madp.core.errors import InputError, OptionError, positive

DIRECTIONS = ("P", "Q")


@dataclasses.dataclass(frozen=True)
class MinSepProcess:
    """One user's participation process under b-min-sep Poisson sampling with BandMF: T steps, min-sep b,
    probability p, up to k_u records, and the bands of C; what the Monte Carlo accountant samples.

    Args:
        steps: T, the training steps.
        min_sep: b, the steps between two participations of a user (at least the bands).
        sampling_prob: p, the probability that a step samples an eligible record (the batch report's).
        max_contributions: k_u, the records of one user (the bound of `madp.bound`).
        coefficients: the bands of C (`coefficients`), non-negative (amplification needs it).

    Returns:
        The process's immutable description, for `calibrate_minsep` and `epsilon_minsep`.

    Raises:
        madp.core.errors.InputError: parameters out of range, more bands than b, or bands with negative
            entries.

    Example:
        >>> from madp.accounting import MinSepProcess, coefficients
        >>> process = MinSepProcess(20, min_sep=4, sampling_prob=0.1, max_contributions=1,
        ...                         coefficients=tuple(coefficients("sqrt", 20, 2)))
        >>> process.count_log_probs.round(4).tolist()  # log P(j records sampled), j = 0..k_u
        [-0.1054, -2.3026]
    """

    steps: int
    min_sep: int
    sampling_prob: float
    max_contributions: int
    coefficients: tuple[float, ...]  # bands of C, len <= min_sep

    def __post_init__(self) -> None:
        check_steps(self.steps)
        check_min_sep(self.min_sep, len(self.coefficients))
        check_probability("sampling_prob", self.sampling_prob)
        check_contributions(self.max_contributions)
        if min(self.coefficients, default=0.0) < 0:
            raise OptionError(
                "b-min-sep amplification (Theorem 6.1 of the b-min-sep paper) needs a non-negative "
                "strategy matrix C; these bands have negative entries {0}: use {strategy} sqrt, or account "
                "without amplification",
                self.coefficients,
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
    if not positive(noise_multiplier):
        raise InputError(f"the noise multiplier must be positive and finite, got {noise_multiplier}")
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


@intrinsic
def _float_of_bits(typingctx, bits):
    """The float64 whose bits are the int64 `bits` (a bit cast, which numba has no function for)."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.DoubleType())

    return types.float64(types.int64), codegen


@njit(inline="always", cache=True, fastmath={"contract"})
def _exp(x):
    """e^x as described above, for x >= -700 (below: e^-700, negligible next to s f_(i+1) where it is used).
    In a loop it vectorizes on AVX2: k goes through int32, as AVX2 has no float64-to-int64 conversion (one
    kept the weights' loop scalar, 3x slower)."""
    x = x if x > -700.0 else -700.0
    k = np.floor(x * _LOG2_E + 0.5)
    r = (x - k * _LN2_HIGH) - k * _LN2_LOW
    series = 0.0
    for coefficient in _TAYLOR:
        series = series * r + coefficient
    return series * _float_of_bits((int64(int32(k)) + 1023) << 52)  # times the float 2^k


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
def _weights(d, kernel, out):
    """W_i = sum_j Binom(j) e^(j d_i - j^2 h_i) (every d_i <= _LINEAR_EXPONENT / k_u): e^(d_i), then Horner's
    rule in it."""
    table = kernel.weight_table
    top = table.shape[0] - 1
    if top == 0:  # k_u = 1: one term, in a loop that vectorizes
        for i in range(d.shape[0]):
            out[i] = table[0, i] * _exp(d[i])
        return
    for i in range(d.shape[0]):
        exponential = _exp(d[i])
        weight = table[top, i]
        for count in range(top - 1, -1, -1):
            weight = weight * exponential + table[count, i]
        out[i] = weight * exponential


@njit(cache=True, fastmath={"contract"})
def _log_f_linear(weights, kernel, f, out):
    """out[r] = log f_0 of f_i = s f_(i+1) + W_i f_(i+b), f_i = 1 past the horizon, in linear space, for the
    first len(out) rows r of `weights` ([_CHAINS, T]), the chains side by side in the columns of f
    ([T + b, _CHAINS]): each step waits on the one before, so interleaved chains cost little more than
    one, and a step's values sit in one cache line or two. Every column is computed (a constant count
    that the compiler unrolls); those past len(out) hold earlier or zero weights and are not read."""
    rows, steps, gap = out.shape[0], weights.shape[1], kernel.min_sep
    f[steps : steps + gap] = 1.0
    log_scale = np.zeros(rows)
    i = steps - 1
    while i >= 0:
        stop = max(i - _CHECK_STEPS, -1)
        for j in range(i, stop, -1):
            now, after, far = f[j], f[j + 1], f[j + gap]
            for r in range(_CHAINS):
                now[r] = kernel.stay * after[r] + weights[r, j] * far[r]
        i = stop
        for r in range(rows):
            current = f[i + 1, r]
            if not 1.0 / _RESCALE_ABOVE <= current <= _RESCALE_ABOVE:
                for j in range(i + 1, i + 1 + gap):  # the f that later steps read
                    f[j, r] /= current
                log_scale[r] += math.log(current)
    for r in range(rows):
        out[r] = math.log(f[0, r]) + log_scale[r]


@njit(inline="always", cache=True)
def _log_add(a, b):
    """log(e^a + e^b), in the math module's functions alone (numba's CUDA target has no np.logaddexp)."""
    high, low = max(a, b), min(a, b)
    return high if low == -math.inf else high + math.log1p(math.exp(low - high))


@njit(cache=True)
def _log_f_log_space(d, kernel, log_f):
    """The same recursion in log space, for weights or spans the linear one cannot hold (also the GPU's,
    one chain per thread: loops, no slice assignment)."""
    steps, gap = d.shape[0], kernel.min_sep
    for i in range(steps, steps + gap):
        log_f[i] = 0.0
    table = kernel.log_weight_table
    for i in range(steps - 1, -1, -1):
        log_weight = -math.inf
        for count in range(table.shape[0]):
            log_weight = _log_add(log_weight, table[count, i] + (count + 1) * d[i])
        log_f[i] = _log_add(kernel.log_stay + log_f[i + 1], log_weight + log_f[i + gap])
    return log_f[0]


@njit(inline="always", cache=True)
def _linear_holds(d, kernel):
    """Whether the linear-space recursion is exact on dots d (see _LINEAR_SPAN); a loop, as the GPU's too."""
    largest = -math.inf
    for i in range(d.shape[0]):
        largest = max(largest, d[i])
    return kernel.linear and kernel.weight_table.shape[0] * largest <= _LINEAR_EXPONENT


@njit(cache=True)
def _participations(state, kernel, steps, at_least_one, starts, counts):
    """One sample's participations by waiting times: at each available step the user takes part with
    probability 1 - s, so the wait is geometric; then it is unavailable for b - 1 steps; its record
    count is Binomial(k_u, p) given >= 1. With `at_least_one`, the first wait is drawn given that it ends
    within the horizon (the process given >= 1 participation). Fills `starts` and `counts`, returns how many."""
    taken = 0
    if at_least_one:
        step = failures_before_success_below(state, kernel.log_stay, steps)
    else:
        step = failures_before_success(state, kernel.log_stay, steps)
    while step < steps:
        starts[taken] = step
        counts[taken] = _records(kernel.count_cdf, uniform(state))
        taken += 1
        step += kernel.min_sep + failures_before_success(state, kernel.log_stay, steps)
    return taken


@njit(inline="always", cache=True)
def _records(count_cdf, u):
    """1 + #{j: count_cdf[j] <= u} (searchsorted's right side, by a scan: k_u is small, and numba's CUDA
    target has no searchsorted); count_cdf ends at 1 > u."""
    records = 1
    while count_cdf[records - 1] <= u:
        records += 1
    return records


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
def _fill_noise(seed, first, samples, steps, noise):
    """Row r < samples: the T standard normals z of sample first + r (stream (seed, sample, 0)); the columns
    past the horizon stay 0."""
    state = np.empty(4, np.uint64)
    for row in range(samples):
        seed_stream(state, seed, first + row, _NOISE)
        fill_standard_normals(noise[row, :steps], state)


@njit(cache=True)
def _direct_dots(noise, kernel, steps, dots):
    for row in range(noise.shape[0]):
        _dots(noise[row], kernel, dots[row, :steps])


class _Workspace(NamedTuple):
    """The arrays a batch of `rows` samples works in, allocated once per draw: where workers return freed
    memory to the system at once (a low MALLOC_TRIM_THRESHOLD_), allocating them per batch made every
    batch fault its pages in again, at 3.5x the cost."""

    noise: np.ndarray  # [rows, width]: z, zero past the horizon
    spectrum: np.ndarray  # [rows, width // 2 + 1]: rfft(z) conj(rfft(c / sigma)) (FFT dots only)
    dots: np.ndarray  # [rows, width]: Q's dots in the first T columns
    p_dots: np.ndarray  # [rows, T]: P's dots (Q's plus the participations')
    weights: np.ndarray  # [2 rows rounded up to _CHAINS, T], zeros at first
    f: np.ndarray  # [T + b, _CHAINS]: the linear-space recursions, a chain per column
    log_f: np.ndarray  # [T + b]: a log-space recursion
    linear_rows: np.ndarray  # [2 rows]: which chains take the linear-space recursion
    results: np.ndarray  # [2 rows]
    starts: np.ndarray  # [T]
    counts: np.ndarray  # [T]
    state: np.ndarray  # [4]: a generator's state


def _workspace(rows: int, width: int, steps: int, min_sep: int) -> _Workspace:
    return _Workspace(
        np.zeros((rows, width)),
        np.empty((rows, width // 2 + 1), np.complex128),
        np.empty((rows, width)),
        np.empty((rows, steps)),
        np.zeros((-(-2 * rows // _CHAINS) * _CHAINS, steps)),
        np.empty((steps + min_sep, _CHAINS)),
        np.empty(steps + min_sep),
        np.empty(2 * rows, np.int64),
        np.empty(2 * rows),
        np.empty(steps, np.int64),
        np.empty(steps, np.int64),
        np.empty(4, np.uint64),
    )


@njit(cache=True)
def _log_ratios_from_dots(kernel, seed, first, samples, with_p, with_q, at_least_one, space, out):
    """out[:, r] = [log P/Q under P, under Q] of sample first + r (r < samples) from its Q dots space.dots[r]
    (under P: plus those of its participations, stream (seed, sample, 1)); a direction not wanted is left
    as it was. Rows whose weights linear space holds exactly run the recursion side by side, the others
    in log space."""
    steps = space.p_dots.shape[1]
    weights, state = space.weights, space.state
    linear = 0
    for r in range(samples):
        if with_p:
            seed_stream(state, seed, first + r, _PARTICIPATIONS)
            space.p_dots[r] = space.dots[r, :steps]
            for m in range(_participations(state, kernel, steps, at_least_one, space.starts, space.counts)):
                _add_participation(space.starts[m], space.counts[m], kernel, space.p_dots[r])
        for direction in range(2):
            if not (with_p, with_q)[direction]:
                continue
            row = space.p_dots[r] if direction == 0 else space.dots[r, :steps]
            if _linear_holds(row, kernel):
                _weights(row, kernel, weights[linear])
                space.linear_rows[linear] = 2 * r + direction
                linear += 1
            else:
                out[direction, r] = _log_f_log_space(row, kernel, space.log_f)
    for group in range(0, linear, _CHAINS):
        end = min(group + _CHAINS, linear)
        _log_f_linear(weights[group : group + _CHAINS], kernel, space.f, space.results[group:end])
    for n in range(linear):
        out[space.linear_rows[n] % 2, space.linear_rows[n] // 2] = space.results[n]


@njit(cache=True)
def _sampled_participations(kernel, seed, samples, steps, at_least_one):
    starts, counts = np.empty(steps, np.int64), np.empty(steps, np.int64)
    found_steps, found_samples, found_counts = [], [], []
    state = np.empty(4, np.uint64)
    for sample in range(samples):
        seed_stream(state, seed, sample, _PARTICIPATIONS)
        for m in range(_participations(state, kernel, steps, at_least_one, starts, counts)):
            found_steps.append(starts[m])
            found_samples.append(sample)
            found_counts.append(counts[m])
    return np.array(found_steps, np.int64), np.array(found_samples, np.int64), np.array(found_counts, np.int64)


# The dots d = C^T z / sigma are a FIR filter of the noise with `bands` taps: T bands multiply-adds
# directly, or O(N log N) by FFT over N >= T + bands - 1 points (no wrap-around reaches an output before
# the horizon, z being zero past it): d = irfft(conj(rfft(c / sigma)) rfft(z)). Measured on one core of
# the 2-core machine at T = 7200, the FFT takes ~45 us a sample against ~300 directly at 256 bands; they
# cross near 48 bands (T = 2000 and 7200). Both give the same dots up to rounding (relative
# ~1e-15 of ||c|| ||z||), which only moves log P/Q by as much: the linear-space bounds above are on the
# dots as computed, whichever way.
FFT_FROM_BANDS = 48
_BATCH_VALUES = 1 << 16  # noise values per batch: 512 kB, so a batch stays in cache (measured)
_CHAINS = 16  # recursions side by side: enough to hide each step's latency (8 take 1.5x the time per chain, measured)


class _Dots(NamedTuple):
    """How a batch's dots are computed: `spectrum` = conj(rfft(c / sigma)) over `width` points, or None
    (directly, over width = T + bands)."""

    width: int
    spectrum: np.ndarray | None


def _dots_plan(kernel: _Kernel, steps: int, fft: bool | None) -> _Dots:
    bands = kernel.coefficients.shape[0]
    if fft is None:
        fft = bands >= FFT_FROM_BANDS
    if not fft:
        return _Dots(steps + bands, None)
    width = scipy.fft.next_fast_len(steps + bands - 1, real=True)
    taps = np.zeros(width)
    taps[:bands] = kernel.coefficients * kernel.inv_sigma
    return _Dots(width, np.conj(scipy.fft.rfft(taps)))


def _batch_dots(space: _Workspace, kernel: _Kernel, plan: _Dots) -> None:
    """space.dots = the Q dots of the noise rows, directly or by FFT (numpy's, which writes into `out`)."""
    if plan.spectrum is None:
        _direct_dots(space.noise, kernel, space.p_dots.shape[1], space.dots)
        return
    np.fft.rfft(space.noise, axis=1, out=space.spectrum)
    np.multiply(space.spectrum, plan.spectrum, out=space.spectrum)
    np.fft.irfft(space.spectrum, plan.width, axis=1, out=space.dots)


def _draw_log_ratios(kernel, seed, samples, steps, with_p, with_q, at_least_one, fft=None) -> np.ndarray:
    """[log P/Q under P, under Q] of samples 0..samples - 1 (NaN in a direction not drawn), a batch of
    samples at a time: their noise, their Q dots, then each sample's participations and recursions."""
    ratios = np.full((2, samples), np.nan)
    plan = _dots_plan(kernel, steps, fft)
    rows = max(1, _BATCH_VALUES // plan.width)
    if rows * (with_p + with_q) < _CHAINS and _CHAINS // (with_p + with_q) * plan.width <= 2 * _BATCH_VALUES:
        rows = _CHAINS // (with_p + with_q)  # one direction: twice the noise, so a group of chains is full
    rows = min(rows, samples)
    space = _workspace(rows, plan.width, steps, kernel.min_sep)
    for first in range(0, samples, rows):
        batch = min(rows, samples - first)
        _fill_noise(seed, first, batch, steps, space.noise)
        _batch_dots(space, kernel, plan)
        _log_ratios_from_dots(kernel, seed, first, batch, with_p, with_q, at_least_one, space, ratios[:, first:])
    return ratios


def log_likelihood_ratio(process: MinSepProcess, noise_multiplier: float, outputs: np.ndarray) -> np.ndarray:
    """log P(y)/Q(y) per sample; `outputs` is T x samples (one column per sample)."""
    outputs = np.asarray(outputs, dtype=np.float64)
    if outputs.ndim != 2 or outputs.shape[0] != process.steps:
        raise ValueError(f"outputs must be {process.steps} x samples, got shape {outputs.shape}")
    kernel = _kernel(process, noise_multiplier)
    plan = _dots_plan(kernel, process.steps, None)
    space = _workspace(outputs.shape[1], plan.width, process.steps, kernel.min_sep)
    space.noise[:, : process.steps] = outputs.T / noise_multiplier
    _batch_dots(space, kernel, plan)
    ratios = np.empty((2, outputs.shape[1]))
    _log_ratios_from_dots(kernel, np.uint64(0), 0, outputs.shape[1], False, True, False, space, ratios)
    return ratios[1]  # the likelihood ratio at these outputs: the Q row, which adds no participations


def sample_log_ratios(
    process: MinSepProcess,
    noise_multiplier: float,
    samples: int,
    seed: int,
    directions: tuple[str, ...] = DIRECTIONS,
    at_least_one: bool = False,
) -> np.ndarray:
    """log P/Q at `samples` outputs drawn under each of `directions` ("P": y = C x + sigma z, "Q": y = sigma z),
    one row per direction; reproducible from `seed`. With `at_least_one`, P's participations x are drawn
    given that there is at least one (the law P_1 of `DeltaReduction`).

    The directions share the noise z (common random numbers): each row is an independent sample of its own
    distribution, which is all a test of that direction needs. Sample n draws z from stream (seed, n, 0)
    and its participations from (seed, n, 1), so a direction's row does not depend on which other
    directions are drawn with it, nor on how samples are batched.
    """
    if not directions or not set(directions) <= set(DIRECTIONS):
        raise ValueError(f"directions must be some of {DIRECTIONS}, got {directions!r}")
    ratios = _draw_log_ratios(
        _kernel(process, noise_multiplier),
        check_seed(seed),
        samples,
        process.steps,
        "P" in directions,
        "Q" in directions,
        at_least_one,
    )[[DIRECTIONS.index(under) for under in directions]]
    if not np.isfinite(ratios).all():  # cannot happen: the linear path runs only where it is exact
        raise FloatingPointError(f"non-finite privacy loss for {process} at sigma {noise_multiplier}")
    return ratios


def sampled_participations(
    process: MinSepProcess, samples: int, seed: int, at_least_one: bool = False
) -> tuple[np.ndarray, ...]:
    """(step, sample, records) of every participation that `sample_log_ratios` draws under P."""
    return _sampled_participations(_kernel(process, 1.0), check_seed(seed), samples, process.steps, at_least_one)


def sampled_noise(process: MinSepProcess, samples: int, seed: int) -> np.ndarray:
    """The standard normals z (T x samples) that `sample_log_ratios` draws: Q's outputs are sigma z."""
    return np.column_stack([standard_normals(seed, sample, _NOISE, process.steps) for sample in range(samples)])


class DeltaReduction(NamedTuple):
    """delta(epsilon) in one direction <= weight E[X], X = (hockey-stick term) / span in [0, 1], on samples
    drawn with `at_least_one` under P (the estimates and tests of `madp.accounting.mc_delta` run on X).

    Let pi_0 = s^T be the chance of no participation at all (each of the T steps, while available, has
    none with probability s = Binom(0)). Its outputs are y = sigma z, Q itself, so P = pi_0 Q + (1 - pi_0) P_1
    with P_1 the law given at least one participation, and P(y) >= pi_0 Q(y): L = log P/Q >= log pi_0.

    - Q: the term (1 - e^(eps + L))_+ <= (1 - pi_0 e^eps)_+ =: r, so weight = span = r. When
      eps >= log(1 / pi_0) (T k_u p <= eps, roughly), r = 0 and delta(Q || P) = 0 exactly: no samples.
    - P: with g = (1 - e^(eps - L))_+, E_Q[g] = E_P[e^-L g] <= e^-eps E_P[g] (g > 0 only where L > eps), so
      delta = pi_0 E_Q[g] + (1 - pi_0) E_P1[g] <= pi_0 e^-eps delta + (1 - pi_0) E_P1[g], i.e.
      delta <= weight E_P1[g] with weight = (1 - pi_0) / (1 - pi_0 e^-eps), span 1. A test on P_1's
      samples needs about weight times the samples of one on P's (pi_0 = 0.42 at T = 7200, p = 1.2e-4:
      0.58x), and the bound gives up at most a factor 1 / (1 - pi_0 e^-eps) in delta. That factor is
      kept below 1 / (1 - MAX_GIVEN_UP) (a candidate's delta would look up to that much larger): where
      pi_0 e^-eps is larger, P is sampled as it is (weight and span 1).
    """

    weight: float
    span: float
    at_least_one: bool = False  # whether the direction's samples are drawn given >= 1 participation (P_1)

    def certified(self, bound: float) -> bool:
        """Whether delta <= weight <= bound holds whatever the samples (E[X] <= 1)."""
        return self.weight <= bound


MAX_GIVEN_UP = 0.1  # P is sampled given >= 1 participation where pi_0 e^-eps <= this


def delta_reduction(process: MinSepProcess, epsilon: float, under: str) -> DeltaReduction:
    """The `DeltaReduction` of `process` at `epsilon` in direction `under`."""
    log_none = process.steps * float(process.count_log_probs[0])  # log pi_0
    if under == "P":
        if log_none - epsilon > math.log(MAX_GIVEN_UP):
            return DeltaReduction(1.0, 1.0)
        return DeltaReduction(float(-np.expm1(log_none) / -np.expm1(log_none - epsilon)), 1.0, True)
    span = float(max(-np.expm1(log_none + epsilon), 0.0))
    return DeltaReduction(span, span)


def reduced_terms(log_ratios: np.ndarray, epsilon: float, under: str, reduction: DeltaReduction) -> np.ndarray:
    """X = hockey-stick term / span, in [0, 1] (`DeltaReduction`)."""
    return np.minimum(hockey_stick_terms(log_ratios, epsilon, under) / reduction.span, 1.0)


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
