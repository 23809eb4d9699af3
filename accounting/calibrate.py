"""From a mechanism to epsilon for a noise multiplier, and back: the smallest sigma for a target.

Privacy loss distributions (dp_accounting's PLD accountant) are discretized pessimistically, so
every epsilon reported here is an upper bound of the true one.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Sequence

from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant

from madp.accounting.mechanisms import Mechanism, check_delta, check_target
from madp.core.errors import InputError, OptionError, positive

log = logging.getLogger("madp.accounting")

# Loss-value grid of the PLD: 1e-3 keeps a T = 10,000 composition near 1 s per evaluation while
# epsilon moves in its fourth digit (measured); the bound stays valid at any grid.
DISCRETIZATION = 1e-3
# A Gaussian's privacy loss spans about 1 / ratio^2 (ratio: its noise over its sensitivity), so the
# grid's points grow as fast below a ratio of 0.1: one Poisson-sampled step at 0.1 holds 143k points,
# at 0.02 1.7 million, and 1000 steps at 0.02 outgrew 6 GB (at 1e-3 any memory). Below that ratio the
# grid widens as 1 / ratio^2, keeping a step near 0.1's points; epsilon stays an upper bound (the
# grid rounds pessimistically), looser only where it is in the hundreds.
FINE_GRID_NOISE_RATIO = 0.1
SIGMA_RANGE = (1e-2, 1e3)
MIN_TOLERANCE = 1e-9  # calibrate's smallest relative precision of sigma: float64 still brackets it


def epsilon(
    mechanism: Mechanism, noise_multiplier: float, delta: float, discretization: float = DISCRETIZATION
) -> float:
    """The epsilon of `mechanism` at `noise_multiplier` for `delta`, by PLD accounting (an upper bound).

    Args:
        mechanism: a `DpSgd`, `DpSgdUls`, `BandMf` or `BandMfCyclic`.
        noise_multiplier: sigma, the noise's standard deviation in units of the clip norm.
        delta: the guarantee's delta, in (0, 1).
        discretization: the PLD's loss-value grid (coarser: faster, looser).

    Returns:
        Epsilon, an upper bound of the true one (inf where the accountant finds no finite one).

    Raises:
        madp.core.errors.InputError: sigma not positive and finite, delta outside (0, 1), or an event the
            accountant cannot build (`Unaccountable`).

    Example:
        >>> from madp.accounting import BandMf, coefficients, epsilon
        >>> mechanism = BandMf(100, min_sep=10, max_participations=10, coefficients=coefficients("sqrt", 100, 4))
        >>> round(epsilon(mechanism, noise_multiplier=4.0, delta=1e-5), 2)
        3.34
    """
    return composed_epsilon(((mechanism, noise_multiplier),), delta, discretization)


def composed_epsilon(
    releases: Sequence[tuple[Mechanism, float]], delta: float, discretization: float = DISCRETIZATION
) -> float:
    """The epsilon for `delta` of independent releases, each a mechanism at its noise multiplier, composed
    (their privacy loss distributions convolved: adaptive composition; an upper bound).

    Args:
        releases: (mechanism, noise multiplier) pairs, one per release (a training).
        delta: the composed guarantee's delta, in (0, 1).
        discretization: the PLD's loss-value grid.

    Returns:
        The composed epsilon, an upper bound.

    Raises:
        madp.core.errors.InputError: a sigma not positive and finite, delta outside (0, 1), or events the
            accountant cannot build.

    Example:
        >>> from madp.accounting import BandMf, coefficients, composed_epsilon
        >>> mechanism = BandMf(100, min_sep=10, max_participations=10, coefficients=coefficients("sqrt", 100, 4))
        >>> round(composed_epsilon([(mechanism, 4.0), (mechanism, 4.0)], delta=1e-5), 2)  # two trainings
        4.98
    """
    for _, noise_multiplier in releases:
        if not positive(noise_multiplier):
            raise OptionError("{noise_multiplier} must be positive and finite, got {0}", noise_multiplier)
    check_delta(delta)
    return _composed_epsilon(tuple((mechanism, sigma) for mechanism, sigma in releases), delta, discretization)


# Remembered per process: a PLD is built anew for each evaluation (seconds for a mixture of Gaussians), and
# the same one recurs: a training's composition is computed as its step is made and again as it enters the
# ledger, and calibrations of one mechanism evaluate the same sigmas. Mechanisms are frozen dataclasses: the
# key is their parameters. A failure is not remembered (raised again each time).
@functools.lru_cache(maxsize=1024)
def _composed_epsilon(releases: tuple[tuple[Mechanism, float], ...], delta: float, discretization: float) -> float:
    events = [mechanism.event(noise_multiplier) for mechanism, noise_multiplier in releases]
    event = events[0] if len(events) == 1 else dp_event.ComposedDpEvent(events)
    widening = max(1.0, (FINE_GRID_NOISE_RATIO / smallest_noise_ratio(event)) ** 2)
    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=discretization * widening)
    try:
        accountant.compose(event)
        return float(accountant.get_epsilon(delta))
    # dp_accounting's own failure, a traceback otherwise; a TypeError where one of its searches found no point
    # and returned None (the tail of a mixture of Gaussians whose mass all but sits at its largest sensitivity)
    except (ValueError, TypeError, OverflowError, MemoryError) as error:
        # each release's name and sigma are values {2i} and {2i+1}; dp_accounting's error follows them
        accounted = " composed with ".join(
            f"{{{2 * index}}} at {{noise_multiplier}} {{{2 * index + 1}:g}}" for index in range(len(releases))
        )
        failure = 2 * len(releases)
        raise Unaccountable(
            f"the PLD accountant cannot account {accounted} (dp_accounting: {{{failure}}}: {{{failure + 1}}}); "
            "raise {noise_multiplier} or the sampling probability, or lower {max_contributions} or {steps}",
            *(value for mechanism, sigma in releases for value in (mechanism.name, sigma)),
            type(error).__name__,
            str(error),
        ) from None


class Unaccountable(OptionError):
    """dp_accounting could not build or compose an event's privacy loss distribution, on some extreme
    ones: a mixture of Gaussians at a sampling probability of 1e-9 and sigma 0.04 or below (a
    ValueError), at max_contributions 100000 (an OverflowError), 10^9 steps (out of memory), at a
    sampling probability within 1e-15 of 1 and some sigmas (a TypeError)."""


def smallest_noise_ratio(event: dp_event.DpEvent) -> float:
    """The smallest noise standard deviation over sensitivity of the Gaussians in `event` (infinite
    where it holds none): what sets the span of its privacy loss."""
    if isinstance(event, dp_event.GaussianDpEvent):
        return event.noise_multiplier
    if isinstance(event, dp_event.MixtureOfGaussiansDpEvent):
        return event.standard_deviation / max(max(event.sensitivities), 1e-300)
    if isinstance(event, (dp_event.PoissonSampledDpEvent, dp_event.SelfComposedDpEvent)):
        return smallest_noise_ratio(event.event)
    if isinstance(event, dp_event.ComposedDpEvent):
        return min((smallest_noise_ratio(part) for part in event.events), default=math.inf)
    return math.inf


def finite_epsilon(mechanism: Mechanism, noise_multiplier: float, delta: float) -> float:
    """`epsilon`, for a guarantee that is stated: an unbounded one (the privacy loss distribution
    holds more than delta at infinite loss, where delta is below what its truncated tail resolves,
    about 1e-15, or sigma is tiny) is an InputError naming both, not an `Infinity` in the output."""
    value = epsilon(mechanism, noise_multiplier, delta)
    if not math.isfinite(value):
        raise OptionError(
            "no finite epsilon for {0} at {noise_multiplier} {1:g} and {delta} {2:g}: the accountant resolves "
            "deltas down to about 1e-15 and needs a sigma large enough; raise {delta} or {noise_multiplier}",
            mechanism.name,
            noise_multiplier,
            delta,
        )
    return value


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What `calibrate` found.

    Args:
        noise_multiplier: sigma, the smallest (to the tolerance) whose epsilon meets the target.
        epsilon: the epsilon at that sigma, at most the target.
        target_epsilon: the target.
        delta: the guarantee's delta.
        evaluations: the PLD evaluations the search took.

    Returns:
        The calibration's immutable record.

    Raises:
        Nothing: `calibrate` makes it.

    Example:
        >>> from madp.accounting import BandMf, calibrate, coefficients
        >>> found = calibrate(BandMf(100, 10, 10, coefficients("sqrt", 100, 4)), target_epsilon=8.0, delta=1e-5)
        >>> round(found.noise_multiplier, 3), found.epsilon <= found.target_epsilon
        (1.898, True)
    """

    noise_multiplier: float
    epsilon: float  # achieved at noise_multiplier, <= the target
    target_epsilon: float
    delta: float
    evaluations: int


def calibrate(
    mechanism: Mechanism,
    target_epsilon: float,
    delta: float,
    relative_tolerance: float = 1e-3,
    discretization: float = DISCRETIZATION,
) -> Calibration:
    """The smallest sigma (to `relative_tolerance`) whose epsilon is at most `target_epsilon`.

    Two bisections on sigma (epsilon decreases with sigma): on a 10x coarser PLD grid to 2%, whose
    answer is valid since coarser grids only overestimate epsilon; then on the fine grid just
    below it. The returned sigma is the upper end of the final bracket, so it meets the target.

    Args:
        mechanism: a `DpSgd`, `DpSgdUls`, `BandMf` or `BandMfCyclic`.
        target_epsilon: the epsilon to meet, positive and finite.
        delta: the guarantee's delta, in (0, 1).
        relative_tolerance: sigma's relative precision, in [1e-9, 1).
        discretization: the fine PLD grid.

    Returns:
        A `Calibration`: sigma, the epsilon it achieves (at most the target), the evaluations.

    Raises:
        madp.core.errors.InputError: a target or delta out of range, a tolerance out of range, or a target
            no sigma in [0.01, 1000] meets.

    Example:
        >>> from madp.accounting import BandMf, calibrate, coefficients
        >>> found = calibrate(BandMf(100, 10, 10, coefficients("sqrt", 100, 4)), target_epsilon=8.0, delta=1e-5)
        >>> round(found.noise_multiplier, 3), round(found.epsilon, 3)
        (1.898, 8.0)
    """
    check_target(target_epsilon, delta)
    if not MIN_TOLERANCE <= relative_tolerance < 1:  # NaN too; below it, bisection stalls between adjacent floats
        raise OptionError(
            "{tolerance} (sigma's relative precision) must be in [{0:g}, 1), got {1}", MIN_TOLERANCE, relative_tolerance
        )
    evaluations = 0

    def on_grid(grid: float):
        def eps(sigma: float) -> float:
            nonlocal evaluations
            evaluations += 1
            value = epsilon(mechanism, sigma, delta, grid)
            log.info("sigma %.6g -> epsilon %.6g (grid %g)", sigma, value, grid)
            return value

        return eps

    coarse, _ = _smallest_sigma(
        on_grid(10 * discretization),
        target_epsilon,
        start=1.0,
        factor=2.0,
        tolerance=max(relative_tolerance, 0.02),
        name=mechanism.name,
        delta=delta,
    )
    sigma, achieved = _smallest_sigma(
        on_grid(discretization),
        target_epsilon,
        start=coarse,
        factor=1.1,
        tolerance=relative_tolerance,
        name=mechanism.name,
        delta=delta,
    )
    return Calibration(sigma, achieved, target_epsilon, delta, evaluations)


def _smallest_sigma(
    eps, target: float, start: float, factor: float, tolerance: float, name: str, delta: float
) -> tuple[float, float]:
    """Bracket the target by steps of `factor` from `start`, then bisect on log sigma."""
    low = high = start
    high_eps = low_eps = eps(start)
    while high_eps > target:
        low, high = high, high * factor
        if high > SIGMA_RANGE[1]:
            raise InputError(
                f"epsilon {target} is unreachable for {name}: sigma = {SIGMA_RANGE[1]:g} still "
                f"gives epsilon {high_eps:.4g} at delta {delta:g}"
            )
        high_eps = eps(high)
    while low_eps <= target:
        if low / factor < SIGMA_RANGE[0]:
            return low, low_eps
        high, high_eps = low, low_eps
        low = low / factor
        try:
            low_eps = eps(low)
        except Unaccountable:  # below the sigmas the accountant can account: the last it did meets the target
            return high, high_eps
    while high / low > 1 + tolerance:
        middle = math.sqrt(low * high)
        middle_eps = eps(middle)
        if middle_eps <= target:
            high, high_eps = middle, middle_eps
        else:
            low = middle
    return high, high_eps
