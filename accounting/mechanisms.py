"""Training mechanisms as small immutable descriptions, each mapped to a dp_accounting DpEvent.

- `DpSgd`: DP-SGD with example-level Poisson sampling (probability q) where a user owns up to k
  records: one step is the mixture of Gaussians with sensitivity j ~ Binomial(k, q) (ELS paper,
  Thm. 1), self-composed over T steps; accounted with PLD only.
- `DpSgdUls`: DP-SGD with user-level Poisson sampling (probability q_user) and one clipped
  gradient per user: PoissonSampled(q_user, Gaussian(sigma)) over T steps.
"""
from __future__ import annotations

import dataclasses
import math

from dp_accounting import dp_event
from scipy.stats import binom

from madp.records import InputError


def _check_probability(name: str, value: float) -> None:
    if not 0 < value <= 1:
        raise InputError(f"{name} must be in (0, 1], got {value}")


def _check_steps(steps: int) -> None:
    if not isinstance(steps, int) or steps < 1:
        raise InputError(f"--steps must be an integer >= 1, got {steps}")


@dataclasses.dataclass(frozen=True)
class DpSgd:
    """Example-level Poisson sampling, up to `max_contributions` records per user."""
    sampling_prob: float
    steps: int
    max_contributions: int = 1

    name = "dpsgd"

    def __post_init__(self) -> None:
        _check_probability("--sampling-prob", self.sampling_prob)
        _check_steps(self.steps)
        if not isinstance(self.max_contributions, int) or self.max_contributions < 1:
            raise InputError(f"--max-contributions must be an integer >= 1, got {self.max_contributions}")

    def event(self, noise_multiplier: float) -> dp_event.DpEvent:
        k = self.max_contributions
        one_step = dp_event.MixtureOfGaussiansDpEvent(
            standard_deviation=noise_multiplier, sensitivities=[float(j) for j in range(k + 1)],
            sampling_probs=binom.pmf(range(k + 1), k, self.sampling_prob).tolist())
        return dp_event.SelfComposedDpEvent(one_step, self.steps)


@dataclasses.dataclass(frozen=True)
class DpSgdUls:
    """User-level Poisson sampling: each step samples users, one clipped gradient per user."""
    user_sampling_prob: float
    steps: int

    name = "dpsgd-uls"

    def __post_init__(self) -> None:
        _check_probability("--user-sampling-prob", self.user_sampling_prob)
        _check_steps(self.steps)

    def event(self, noise_multiplier: float) -> dp_event.DpEvent:
        step = dp_event.PoissonSampledDpEvent(self.user_sampling_prob, dp_event.GaussianDpEvent(noise_multiplier))
        return dp_event.SelfComposedDpEvent(step, self.steps)


Mechanism = DpSgd | DpSgdUls


def sampling_probability(batch_size: float, dataset_size: int) -> float:
    """Poisson sampling probability that gives `batch_size` expected rows out of `dataset_size`."""
    if dataset_size < 1 or not 0 < batch_size <= dataset_size:
        raise InputError(f"--batch-size must be in (0, --dataset-size], got {batch_size} of {dataset_size}")
    return batch_size / dataset_size


def check_target(epsilon: float, delta: float) -> None:
    if not (epsilon > 0 and math.isfinite(epsilon)):
        raise InputError(f"--epsilon must be > 0, got {epsilon}")
    if not 0 < delta < 1:
        raise InputError(f"--delta must be in (0, 1), got {delta}")
