"""Banded lower-triangular Toeplitz strategy matrices C for BandMF, given by their bands c_0..c_{b-1}.

Coefficients are normalized to unit l2 norm, so one participation has sensitivity 1 (the norm
of a full column of C) and sigma is the noise multiplier relative to the clip norm.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import minimize
from scipy.signal import lfilter

from madp.core.errors import OptionError, check_memory

STRATEGIES = ("sqrt", "optimized")
# Bytes per step prefix_sum_mse holds at its peak (float64 arrays of T entries; 23 measured at T = 1e8).
MSE_BYTES_PER_STEP = 40


def check_bands(steps: int, bands: int) -> None:
    if not isinstance(steps, int) or not 1 <= steps < 2**63:
        raise OptionError("{steps} must be an integer in [1, 2^63), got {0}", steps)
    if not isinstance(bands, int) or not 1 <= bands <= steps:
        raise OptionError("{bands} must be an integer in [1, {steps}], got {0}", bands)


def sqrt_coefficients(bands: int) -> np.ndarray:
    """Banded square root of the prefix-sum matrix: c_0 = 1, c_j = c_{j-1} (2j-1)/(2j), truncated, normalized.

    The untruncated c are the series of (1 - x)^(-1/2), whose square is the all-ones series.
    """
    j = np.arange(1, bands)
    coefficients = np.concatenate([[1.0], np.cumprod((2 * j - 1) / (2 * j))])
    return coefficients / np.linalg.norm(coefficients)


def prefix_sum_mse(coefficients: np.ndarray, steps: int) -> float:
    """Mean squared error per step of prefix sums under C: ||A C^-1||_F^2 / T times the squared sensitivity.

    C^-1 is lower-triangular Toeplitz with first column d (an IIR filter of the bands), so
    B = A C^-1 is Toeplitz with first column D = cumsum(d) and ||B||_F^2 = sum_n (T - n) D_n^2.
    Refused, before allocating, where those arrays would not fit in half of this machine's memory.

    Args:
        coefficients: the bands of C (`coefficients`).
        steps: T.

    Returns:
        The error per step, in units of sigma^2 ((T + 1) / 2 with one band, DP-SGD's noise).

    Raises:
        madp.core.errors.InputError: arrays of T entries that would not fit in memory.

    Example:
        >>> from madp.accounting import coefficients, prefix_sum_mse
        >>> [round(prefix_sum_mse(coefficients("sqrt", 100, bands), 100), 1) for bands in (1, 4)]
        [50.5, 16.8]
    """
    check_memory(
        steps * MSE_BYTES_PER_STEP,
        f"--steps {steps}: the prefix-sum MSE of a BandMF strategy over that many steps holds",
        "use fewer --steps (training and accounting with --strategy sqrt build its bands without this error)",
    )
    impulse = np.zeros(steps)
    impulse[0] = 1.0
    first_column = np.cumsum(lfilter([1.0], coefficients, impulse))
    frobenius = float(np.sum((steps - np.arange(steps)) * first_column**2))
    return frobenius / steps * float(np.sum(coefficients[:steps] ** 2))


def optimized_coefficients(steps: int, bands: int) -> np.ndarray:
    """Bands minimizing the prefix-sum MSE for `steps` (L-BFGS from the square root), normalized."""
    start = sqrt_coefficients(bands)
    if bands == 1:
        return start
    bounds = [(1e-3, None)] + [(None, None)] * (bands - 1)  # c_0 > 0 keeps C invertible
    result = minimize(lambda c: prefix_sum_mse(c, steps), start, method="L-BFGS-B", bounds=bounds)
    best = result.x if result.fun < prefix_sum_mse(start, steps) else start
    return best / np.linalg.norm(best)


def coefficients(strategy: str, steps: int, bands: int) -> np.ndarray:
    """The bands of a BandMF strategy matrix C, normalized to unit norm (one participation: sensitivity 1).

    Args:
        strategy: "sqrt" (the banded square root of the prefix-sum matrix) or "optimized" (the banded
            Toeplitz C of least prefix-sum error for `steps`, found by L-BFGS).
        steps: T, the training steps.
        bands: the bands of C, in [1, T] (1: DP-SGD's independent noise).

    Returns:
        The bands c_0..c_{bands-1}, a float64 array.

    Raises:
        madp.core.errors.InputError: an unknown strategy, or T or bands out of range.

    Example:
        >>> from madp.accounting import coefficients
        >>> coefficients("sqrt", steps=100, bands=3).round(3).tolist()
        [0.848, 0.424, 0.318]
    """
    check_bands(steps, bands)
    if strategy == "sqrt":
        return sqrt_coefficients(bands)
    if strategy == "optimized":
        return optimized_coefficients(steps, bands)
    raise OptionError("{strategy} must be one of {0}, got {1!r}", STRATEGIES, strategy)
