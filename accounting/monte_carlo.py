"""Monte Carlo accounting kernels for BandMF with (multi-attribution) b-min-sep Poisson sampling.

The worst case of one user is the matrix mechanism y = C x + z, z ~ N(0, sigma^2 I) (P), against
y = z (Q). Under P the user is available at step i unless it participated in the previous b - 1
steps; when available it contributes x_i ~ Binomial(k_u, p) records (k_u = 1: Alg. 1 of the
b-min-sep paper; k_u > 1: Sec. 6.2). The likelihood ratio P(y)/Q(y) is f_1 of the backward
recursion (eq. (1), extended to Binomial counts):

    f_i = Binom(0) f_{i+1} + sum_{j>=1} Binom(j) r_i(j) f_{i+b},   f_i = 1 for i > T,
    r_i(j) = exp((j <c_i, y_i..y_{i+b-1}> - j^2 ||c_i||^2 / 2) / sigma^2),

with c_i the nonzero part of column i of C. Samples are vectorized in blocks; the recursion runs
in linear space with per-sample rescaling (log space when weights are extreme). Estimate-verify-
release (`accounting/evr.py`) turns these estimates into a formal guarantee.
"""
from __future__ import annotations

import dataclasses

import numpy as np
from scipy.stats import binom

from accounting.mechanisms import check_contributions, check_min_sep, check_probability, check_steps


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

    @property
    def count_log_probs(self) -> np.ndarray:
        """log Binomial(j; k_u, p) for j = 0..k_u."""
        return binom.logpmf(np.arange(self.max_contributions + 1), self.max_contributions, self.sampling_prob)


def sample_participations(process: MinSepProcess, samples: int,
                          rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(step, sample, records) of every participation, by waiting times between participations.

    At each available step the user takes part with probability p' = P(Binomial(k_u, p) >= 1),
    so the wait to its next participation is Geometric(p'); after one it is unavailable for
    b - 1 steps; the record count is Binomial(k_u, p) conditioned on being >= 1.
    """
    count_probs = np.exp(process.count_log_probs)
    participate = 1.0 - count_probs[0]
    steps, sample_ids, counts = [], [], []
    position = rng.geometric(participate, samples) - 1
    alive = np.arange(samples)
    while len(alive):
        inside = position < process.steps
        alive, position = alive[inside], position[inside]
        steps.append(position)
        sample_ids.append(alive)
        counts.append(1 + rng.choice(process.max_contributions, size=len(alive),
                                     p=count_probs[1:] / participate) if process.max_contributions > 1
                      else np.ones(len(alive), dtype=np.int64))
        position = position + process.min_sep + rng.geometric(participate, len(alive)) - 1
    return np.concatenate(steps), np.concatenate(sample_ids), np.concatenate(counts)


def mean_shift(process: MinSepProcess, participations: tuple[np.ndarray, np.ndarray, np.ndarray],
               samples: int) -> np.ndarray:
    """C x for each sample (T x samples). A sample's participations are >= b >= bands apart, so
    their columns of C never overlap and each entry is written once."""
    shift = np.zeros((process.steps, samples))
    steps, sample_ids, counts = participations
    for lag, value in enumerate(process.coefficients):
        inside = steps + lag < process.steps
        shift[steps[inside] + lag, sample_ids[inside]] = value * counts[inside]
    return shift


# Largest log participation weight of the linear-space path: between two rescalings (every b
# steps) a path picks up at most two weights, so values stay below exp(2 * 250) < float max.
_LINEAR_LOG_WEIGHT_LIMIT = 250.0
_CHUNK = 1024  # samples per block: the (T x chunk) arrays stay in cache


def log_likelihood_ratio(process: MinSepProcess, noise_multiplier: float, outputs: np.ndarray) -> np.ndarray:
    """log P(y)/Q(y) per sample; `outputs` is T x samples (one column per sample)."""
    return np.concatenate([_log_ratio_block(process, noise_multiplier, outputs[:, start:start + _CHUNK])
                           for start in range(0, outputs.shape[1], _CHUNK)]) if outputs.shape[1] else np.zeros(0)


def _log_participation_weight(process: MinSepProcess, noise_multiplier: float, by_step: np.ndarray) -> np.ndarray:
    """log W_i = log sum_j Binom(j) r_i(j) for every step (rows) and sample (columns).

    W_i does not depend on f, so it is computed for all steps at once.
    """
    steps = by_step.shape[0]
    c = np.asarray(process.coefficients, dtype=np.float64)
    dots = by_step * c[0]  # dots_i = <c_i, y_i..y_{i+bands-1}>, truncated at the horizon
    scratch = np.empty_like(by_step)
    for lag in range(1, len(c)):
        np.multiply(by_step[lag:], c[lag], out=scratch[: steps - lag])
        dots[: steps - lag] += scratch[: steps - lag]
    # ||c_i||^2: the bands that fit before the horizon.
    column_norms = np.cumsum(c ** 2)[np.minimum(len(c), steps - np.arange(steps)) - 1][:, None]
    log_probs, variance = process.count_log_probs, noise_multiplier ** 2

    def log_term(count: int) -> np.ndarray:  # log Binom(count) + log r_i(count), in place on a copy
        term = dots * (count / variance)
        term -= column_norms * (count ** 2 / (2 * variance))
        term += log_probs[count]
        return term

    log_weight = log_term(1)
    for count in range(2, process.max_contributions + 1):
        np.logaddexp(log_weight, log_term(count), out=log_weight)
    return log_weight


def _log_ratio_block(process: MinSepProcess, noise_multiplier: float, outputs: np.ndarray) -> np.ndarray:
    by_step = np.ascontiguousarray(outputs)
    log_weight = _log_participation_weight(process, noise_multiplier, by_step)
    if log_weight.max() <= _LINEAR_LOG_WEIGHT_LIMIT:
        return _recursion_linear(process, log_weight)
    return _recursion_log(process, log_weight)


def _recursion_linear(process: MinSepProcess, log_weight: np.ndarray) -> np.ndarray:
    """f_i = Binom(0) f_{i+1} + W_i f_{i+b} in linear space; every b steps the live window (rows
    i..i+b) is divided by its per-sample maximum, whose log accumulates in `log_scale`."""
    steps, samples = log_weight.shape
    gap = process.min_sep
    weight = np.exp(log_weight)
    stay = float(np.exp(process.count_log_probs[0]))
    f = np.ones((steps + gap, samples))
    log_scale = np.zeros(samples)
    scratch = np.empty(samples)
    for i in range(steps - 1, -1, -1):
        np.multiply(weight[i], f[i + gap], out=f[i])
        np.multiply(f[i + 1], stay, out=scratch)
        f[i] += scratch
        if i % gap == 0:
            window = f[i:i + gap + 1]
            peak = window.max(axis=0)
            window /= peak
            log_scale += np.log(peak)
    return np.log(f[0]) + log_scale


def _recursion_log(process: MinSepProcess, log_weight: np.ndarray) -> np.ndarray:
    """The same recursion in log space, for weights too large for the linear path."""
    steps, samples = log_weight.shape
    log_f = np.zeros((steps + process.min_sep, samples))
    stay = process.count_log_probs[0]
    for i in range(steps - 1, -1, -1):
        np.logaddexp(stay + log_f[i + 1], log_weight[i] + log_f[i + process.min_sep], out=log_f[i])
    return log_f[0].copy()


def sample_log_ratios(process: MinSepProcess, noise_multiplier: float, samples: int, seed: int,
                      under: str) -> np.ndarray:
    """log P/Q at outputs drawn under P (`under="P"`) or under Q (`"Q"`); reproducible from `seed`.

    Drawn and evaluated in blocks of samples, so the T x block arrays stay in cache.
    """
    if under not in ("P", "Q"):
        raise ValueError(f"under must be 'P' or 'Q', got {under!r}")
    rng = np.random.default_rng(seed)
    blocks = []
    for start in range(0, samples, _CHUNK):
        size = min(_CHUNK, samples - start)
        outputs = rng.standard_normal((process.steps, size))
        outputs *= noise_multiplier
        if under == "P":
            outputs += mean_shift(process, sample_participations(process, size, rng), size)
        blocks.append(_log_ratio_block(process, noise_multiplier, outputs))
    return np.concatenate(blocks) if blocks else np.zeros(0)


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
