"""Estimate-verify-release arithmetic (b-min-sep paper, App. A; Chua et al., Fact 4.2).

A Monte Carlo verifier accepts a noise multiplier when its delta estimate from s samples is at
most a base delta d'. If the true divergence exceeds delta > d', the estimate (a mean of s i.i.d.
values in [0, 1]) falls to d' with probability at most q = exp(-s KL(d' || delta)) (Chernoff-
Hoeffding). Algorithm 5 then satisfies (epsilon, delta + q (1 - delta))-DP, minimized over delta.
"""
from __future__ import annotations

import math

from scipy.optimize import minimize_scalar

from madp.records import InputError


def bernoulli_kl(a: float, b: float) -> float:
    """KL(Bernoulli(a) || Bernoulli(b))."""
    return a * math.log(a / b) + (1 - a) * math.log((1 - a) / (1 - b))


def failure_probability(base_delta: float, delta: float, samples: int) -> float:
    """Bound on Pr[estimate <= base_delta] when the true divergence is delta > base_delta."""
    return math.exp(-samples * bernoulli_kl(base_delta, delta))


def overall_delta(base_delta: float, samples: int, target_delta: float) -> float:
    """min over delta in (base_delta, target_delta] of delta + q(delta) (1 - delta)."""
    def value(log_delta: float) -> float:
        delta = math.exp(log_delta)
        return delta + failure_probability(base_delta, delta, samples) * (1 - delta)

    result = minimize_scalar(value, bounds=(math.log(base_delta) + 1e-12, math.log(target_delta)), method="bounded",
                             options={"xatol": 1e-10})
    return min(result.fun, value(math.log(target_delta)))


def samples_needed(target_delta: float, base_delta: float) -> int:
    """Fewest Monte Carlo samples s with overall_delta(base_delta, s) <= target_delta."""
    if not 0 < base_delta < target_delta < 1:
        raise InputError(f"need 0 < base delta < target delta < 1, got {base_delta} and {target_delta}")
    low, high = 1, 2
    while overall_delta(base_delta, high, target_delta) > target_delta:
        low, high = high, 2 * high
    while high - low > 1:
        middle = (low + high) // 2
        if overall_delta(base_delta, middle, target_delta) <= target_delta:
            high = middle
        else:
            low = middle
    return high
