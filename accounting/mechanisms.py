"""Training mechanisms as small immutable descriptions, each mapped to a dp_accounting DpEvent.

- `DpSgd`: DP-SGD with example-level Poisson sampling (probability q) where a user owns up to k
  records: one step is the mixture of Gaussians with sensitivity j ~ Binomial(k, q) (ELS paper,
  Thm. 1), self-composed over T steps; accounted with PLD only. At q = 1 (every record in every step)
  there is no amplification: T Gaussian mechanisms of sensitivity k, one of sensitivity sqrt(T) k.
- `DpSgdUls`: DP-SGD with user-level Poisson sampling (probability q_user) and one clipped
  gradient per user: PoissonSampled(q_user, Gaussian(sigma)) over T steps.
- `BandMf`: BandMF without amplification on (k, b)-min-sep batches (each user in at most k
  steps, at least b apart, with at most `records_per_step` of its records in one step). With a
  `bands`-banded Toeplitz C and b >= bands, participations touch disjoint rows of C, so
  ||C x||^2 is the sum of their columns' squared norms: one Gaussian mechanism (b-min-sep paper,
  Sec. 2.3) whose sensitivity is that sum at its largest.
- `BandMfCyclic`: BandMF with cyclic Poisson sampling, for comparison (Sec. 3).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from dp_accounting import dp_event
from scipy.stats import binom

from madp.core.errors import OptionError


def check_probability(name: str, value: float) -> None:
    """The probability parameter `name` is in (0, 1]."""
    if not 0 < value <= 1:
        raise OptionError(f"{{{name}}} must be in (0, 1], got {{0}}", value)


def check_steps(steps: int) -> None:
    if not isinstance(steps, int) or steps < 1:
        raise OptionError("{steps} must be an integer >= 1, got {0}", steps)


def check_min_sep(min_sep: int, bands: int) -> None:
    """Participations at least `min_sep` apart touch disjoint rows of a C with at most that many bands."""
    if not isinstance(min_sep, int) or min_sep < 1:
        raise OptionError("{min_sep} must be an integer >= 1, got {0}", min_sep)
    if bands > min_sep:
        raise OptionError(
            "{bands} ({0}) must not exceed {min_sep} ({1}): participations closer than the bands overlap in C "
            "and these analyses do not hold",
            bands,
            min_sep,
        )


def check_contributions(max_contributions: int) -> None:
    if not isinstance(max_contributions, int) or max_contributions < 1:
        raise OptionError("{max_contributions} must be an integer >= 1, got {0}", max_contributions)


@dataclasses.dataclass(frozen=True)
class DpSgd:
    """DP-SGD with example-level Poisson sampling, up to `max_contributions` records per user: each step is
    the mixture of Gaussians with sensitivity j ~ Binomial(k, q), self-composed over the steps; at q = 1, the
    Gaussian mechanism of sensitivity k composed over the steps (one of sensitivity sqrt(T) k).

    Args:
        sampling_prob: q, the probability that a step samples a record (`sampling_probability`).
        steps: T, the training steps.
        max_contributions: k, the records one user has at most (the bound of `madp.bound`).

    Returns:
        The mechanism's immutable description; `event(sigma)` is its dp_accounting event, which
        `calibrate`, `epsilon` and `composed_epsilon` account.

    Raises:
        madp.core.errors.InputError: q outside (0, 1], T or k not an integer >= 1.

    Example:
        >>> from madp.accounting import DpSgd, epsilon, sampling_probability
        >>> mechanism = DpSgd(sampling_probability(64, 10_000), steps=100, max_contributions=2)
        >>> round(epsilon(mechanism, noise_multiplier=1.0, delta=1e-5), 2)
        0.97
    """

    sampling_prob: float
    steps: int
    max_contributions: int = 1

    name = "dpsgd"

    def __post_init__(self) -> None:
        check_probability("sampling_prob", self.sampling_prob)
        check_steps(self.steps)
        check_contributions(self.max_contributions)

    def event(self, noise_multiplier: float) -> dp_event.DpEvent:
        k = self.max_contributions
        if self.sampling_prob == 1:
            # Every record in every step: no amplification, T Gaussian mechanisms of sensitivity k, which compose
            # exactly into one of sensitivity sqrt(T) k. (dp_accounting's mixture with all its mass on k fails at
            # some sigmas: its tail search starts on the answer, misses it by a rounding and returns None.)
            return dp_event.GaussianDpEvent(noise_multiplier / (k * math.sqrt(self.steps)))
        one_step = dp_event.MixtureOfGaussiansDpEvent(
            standard_deviation=noise_multiplier,
            sensitivities=[float(j) for j in range(k + 1)],
            sampling_probs=binom.pmf(range(k + 1), k, self.sampling_prob).tolist(),
        )
        return dp_event.SelfComposedDpEvent(one_step, self.steps)


@dataclasses.dataclass(frozen=True)
class DpSgdUls:
    """DP-SGD with user-level Poisson sampling: each step samples users, one clipped gradient per user.

    Args:
        user_sampling_prob: the probability that a step samples a user.
        steps: T, the training steps.

    Returns:
        The mechanism's immutable description; `event(sigma)` is its dp_accounting event.

    Raises:
        madp.core.errors.InputError: a probability outside (0, 1], T not an integer >= 1.

    Example:
        >>> from madp.accounting import DpSgdUls, epsilon
        >>> round(epsilon(DpSgdUls(user_sampling_prob=0.01, steps=100), noise_multiplier=1.0, delta=1e-5), 2)
        0.72
    """

    user_sampling_prob: float
    steps: int

    name = "dpsgd-uls"

    def __post_init__(self) -> None:
        check_probability("user_sampling_prob", self.user_sampling_prob)
        check_steps(self.steps)

    def event(self, noise_multiplier: float) -> dp_event.DpEvent:
        step = dp_event.PoissonSampledDpEvent(self.user_sampling_prob, dp_event.GaussianDpEvent(noise_multiplier))
        return dp_event.SelfComposedDpEvent(step, self.steps)


@dataclasses.dataclass(frozen=True)
class BandMf:
    """BandMF without amplification on (k, b)-min-sep batches (`madp.batch` with min_sep b), with the
    strategy bands `coefficients`: one Gaussian mechanism whose sensitivity is `sensitivity`.

    Args:
        steps: T, the training steps.
        min_sep: b, the steps between two participations of a user (at least the bands).
        max_participations: k, the steps a user takes part in at most (at most ceil(T / b)).
        coefficients: the bands of C (`coefficients`), normalized to unit norm.
        records_per_step: the records of one user in one step at most.

    Returns:
        The mechanism's immutable description; `event(sigma)` is its dp_accounting event.

    Raises:
        madp.core.errors.InputError: more bands than b, k out of [1, ceil(T / b)], a count not an integer.

    Example:
        >>> from madp.accounting import BandMf, coefficients, epsilon
        >>> mechanism = BandMf(100, min_sep=10, max_participations=10, coefficients=coefficients("sqrt", 100, 4))
        >>> round(mechanism.sensitivity, 3), round(epsilon(mechanism, noise_multiplier=4.0, delta=1e-5), 2)
        (3.162, 3.34)
    """

    steps: int
    min_sep: int
    max_participations: int
    coefficients: tuple[float, ...]
    records_per_step: int = 1

    name = "bandmf"

    def __post_init__(self) -> None:
        # a tuple of floats whatever the caller gave (a list, a numpy array): the accountant remembers
        # epsilons by the mechanism's value, which must hash
        object.__setattr__(self, "coefficients", tuple(float(c) for c in self.coefficients))
        check_steps(self.steps)
        check_min_sep(self.min_sep, len(self.coefficients))
        most = 1 + (self.steps - 1) // self.min_sep
        if not isinstance(self.max_participations, int) or not 1 <= self.max_participations <= most:
            raise OptionError(
                "{max_participations} must be an integer in [1, {0}] for {1} steps at min-sep {2}, got {3}",
                most,
                self.steps,
                self.min_sep,
                self.max_participations,
            )
        if not isinstance(self.records_per_step, int) or self.records_per_step < 1:
            raise OptionError("{records_per_step} must be an integer >= 1, got {0}", self.records_per_step)

    @property
    def sensitivity(self) -> float:
        """max ||C x|| over (k, b)-min-sep participations x.

        Column j of C holds the bands that fit before the horizon, so column norms never grow
        with j and the worst case participates as early as possible: steps 0, b, ..., (k-1) b,
        each time with `records_per_step` clipped records.
        """
        squares = np.asarray(self.coefficients, dtype=np.float64) ** 2
        starts = self.min_sep * np.arange(self.max_participations)
        return self.records_per_step * math.sqrt(sum(float(squares[: self.steps - start].sum()) for start in starts))

    def event(self, noise_multiplier: float) -> dp_event.DpEvent:
        return dp_event.GaussianDpEvent(noise_multiplier / self.sensitivity)


@dataclasses.dataclass(frozen=True)
class BandMfCyclic:
    """BandMF with cyclic Poisson sampling (single attribution; b-min-sep paper, Sec. 3).

    The data is split into `min_sep` = b subsets and step i Poisson-samples subset i mod b with
    probability `sampling_prob`. An example of the first subset can take part in steps 0, b, 2b,
    ...: ceil(T / b) chances whose rows of C (at most b bands) do not overlap, so the mechanism is
    ceil(T / b) Poisson-subsampled Gaussians with sensitivity one column norm of C.

    Args:
        sampling_prob: the probability that a step samples an example of its subset.
        steps: T, the training steps.
        min_sep: b, the subsets (at least the bands).
        coefficients: the bands of C (`coefficients`).

    Returns:
        The mechanism's immutable description; `event(sigma)` is its dp_accounting event.

    Raises:
        madp.core.errors.InputError: a probability outside (0, 1], more bands than b, T not an integer >= 1.

    Example:
        >>> from madp.accounting import BandMfCyclic, coefficients, epsilon
        >>> mechanism = BandMfCyclic(0.1, steps=100, min_sep=4, coefficients=coefficients("sqrt", 100, 4))
        >>> round(epsilon(mechanism, noise_multiplier=2.0, delta=1e-5), 2)
        1.19
    """

    sampling_prob: float
    steps: int
    min_sep: int
    coefficients: tuple[float, ...]

    name = "bandmf-cyclic"

    def __post_init__(self) -> None:
        object.__setattr__(self, "coefficients", tuple(float(c) for c in self.coefficients))  # hashable (BandMf)
        check_probability("sampling_prob", self.sampling_prob)
        check_steps(self.steps)
        check_min_sep(self.min_sep, len(self.coefficients))  # min_sep: the number of subsets

    def event(self, noise_multiplier: float) -> dp_event.DpEvent:
        column = float(np.linalg.norm(self.coefficients[: self.steps]))
        step = dp_event.PoissonSampledDpEvent(self.sampling_prob, dp_event.GaussianDpEvent(noise_multiplier / column))
        return dp_event.SelfComposedDpEvent(step, -(-self.steps // self.min_sep))


Mechanism = DpSgd | DpSgdUls | BandMf | BandMfCyclic


def sampling_probability(batch_size: float, dataset_size: int) -> float:
    """The Poisson sampling probability that gives `batch_size` expected rows out of `dataset_size`.

    Args:
        batch_size: the expected rows of a step.
        dataset_size: the rows sampled from.

    Returns:
        batch_size / dataset_size.

    Raises:
        madp.core.errors.InputError: a batch size outside (0, dataset_size], or no rows.

    Example:
        >>> from madp.accounting import sampling_probability
        >>> sampling_probability(64, 10_000)
        0.0064
    """
    if dataset_size < 1 or not 0 < batch_size <= dataset_size:
        raise OptionError("{batch_size} must be in (0, {dataset_size}], got {0} of {1}", batch_size, dataset_size)
    return batch_size / dataset_size


def check_delta(delta: float) -> None:
    if not 0 < delta < 1:
        raise OptionError("{delta} must be in (0, 1), got {0}", delta)


def check_target(epsilon: float, delta: float) -> None:
    if not (epsilon > 0 and math.isfinite(epsilon)):
        raise OptionError("{epsilon} must be > 0, got {0}", epsilon)
    check_delta(delta)
