"""Betting tests on the mean of [0, 1] terms: their level under optional stopping, their power against the
fixed-sample Chernoff test that estimate-verify-release used before, and the sample floor."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.special import logsumexp

from madp.accounting.betting import BETS, log_wealth, log_wealth_steps, samples_to_reject_on_zeros


def first_rejection(terms: np.ndarray, bound: float, level: float, chunk: int) -> int | None:
    """Terms read when the wealth against "mean >= bound" first reaches 1 / level, looking after every chunk:
    the wealth after each chunk is summed from per-chunk `log_wealth_steps`, as the verifier does."""
    totals = np.cumsum(
        [log_wealth_steps(terms[start : start + chunk], bound) for start in range(0, len(terms), chunk)], axis=0
    )
    wealth = logsumexp(totals[:, : len(BETS)], axis=1) - math.log(len(BETS))  # log_wealth, after every chunk
    assert wealth[-1] == pytest.approx(log_wealth(totals[-1])[0])
    crossed = np.flatnonzero(wealth >= math.log(1 / level))
    return min(len(terms), (crossed[0] + 1) * chunk) if len(crossed) else None


def chernoff_fixed_samples(bound: float, level: float) -> int:
    """Samples a fixed-size test with threshold bound / 2 needs: exp(-n KL(bound / 2 || bound)) <= level."""
    a = bound / 2
    kl = a * math.log(a / bound) + (1 - a) * math.log((1 - a) / (1 - bound))
    return math.ceil(math.log(1 / level) / kl)


@pytest.mark.slow
def test_level_holds_under_optional_stopping_at_the_worst_case_mean():
    """Bernoulli terms with mean exactly the bound (the hardest null for terms in [0, 1]), looked at after
    every 25 terms for 5000 terms: the test rejects at most about `level` of the time."""
    rng = np.random.default_rng(0)
    bound, level, runs = 0.02, 0.1, 600
    rejected = sum(
        first_rejection((rng.random(5000) < bound).astype(float), bound, level, 25) is not None for _ in range(runs)
    )
    assert rejected <= level * runs + 3 * math.sqrt(level * runs), rejected


def test_fractional_terms_reject_sooner_than_the_fixed_sample_test():
    """Terms like the hockey-stick terms (mostly 0, otherwise a fraction of 1) at a quarter of the bound:
    the betting test stops well before the fixed-sample Chernoff test could decide."""
    rng = np.random.default_rng(1)
    bound, level = 1e-3, 1e-6
    terms = np.where(rng.random(400_000) < bound / 2, rng.uniform(0.0, 1.0, 400_000), 0.0)  # mean bound / 4
    stopped = first_rejection(terms, bound, level, 1000)
    assert stopped is not None and stopped < chernoff_fixed_samples(bound, level) / 3, stopped


def test_evidence_against_a_mean_above_the_bound_grows():
    rng = np.random.default_rng(2)
    bound = 0.01
    above = log_wealth(log_wealth_steps((rng.random(20_000) < 3 * bound).astype(float), bound))
    below = log_wealth(log_wealth_steps((rng.random(20_000) < bound / 4).astype(float), bound))
    assert above[1] > math.log(1e6) and above[0] < 0
    assert below[0] > math.log(1e6) and below[1] < 0


def test_all_zero_terms_reject_at_the_stated_floor():
    bound, level = 1e-4, 1e-7
    floor = samples_to_reject_on_zeros(bound, level)
    assert log_wealth(log_wealth_steps(np.zeros(floor), bound))[0] >= math.log(1 / level)
    assert log_wealth(log_wealth_steps(np.zeros(floor // 2), bound))[0] < math.log(1 / level)
    assert floor < chernoff_fixed_samples(bound, level) / 4
