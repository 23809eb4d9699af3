"""Anytime-valid tests on the mean of i.i.d. terms in [0, 1], by betting (test supermartingales and Ville's inequality).

To test H: mean >= b, a gambler starts with wealth 1 and stakes a fraction lambda of it against each
term: wealth_n = prod_i (1 + lambda (b - X_i)). Under H each factor has expectation
1 + lambda (b - mean) <= 1 and is >= 0 when lambda <= 1 / (1 - b), so wealth is a non-negative
supermartingale and, by Ville's inequality, Pr_H[wealth ever reaches 1 / alpha] <= alpha: the test may
look after every term and stop whenever it likes. An average of such wealths (one per bet in a fixed
grid) is one too, so the grid adapts the bet to the data at a cost of log(len(grid)) in the threshold.
When the terms are mostly 0 and otherwise fractional, the wealth grows by about
lambda (b - mean - Var/2) per term, faster than any fixed-sample Chernoff bound for Bernoulli terms.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.special import logsumexp

# The bets lambda, for both tests: factors 1 + lambda (b - X) >= 0 need lambda <= 1 / (1 - b), and
# 1 + lambda (X - b) >= 0 need lambda <= 1 / b; both hold below 1.
BETS = (0.25, 0.5, 0.75, 0.9, 0.99)


def log_wealth_steps(terms: np.ndarray, bound: float) -> np.ndarray:
    """Per bet, sum_i log(1 + lambda (bound - X_i)) and sum_i log(1 + lambda (X_i - bound)): the log wealth
    gained by these terms against "mean >= bound" (first half) and against "mean <= bound" (second)."""
    bets = np.asarray(BETS)[:, None]
    below = np.log1p(bets * (bound - terms[None, :])).sum(axis=1)
    above = np.log1p(bets * (terms[None, :] - bound)).sum(axis=1)
    return np.concatenate([below, above])


def log_wealth(steps_total: np.ndarray) -> tuple[float, float]:
    """log of the grid-averaged wealth against "mean >= bound" and against "mean <= bound", from the summed
    `log_wealth_steps` of all terms so far."""
    below, above = np.split(np.asarray(steps_total, dtype=np.float64), 2)
    return float(logsumexp(below) - math.log(len(BETS))), float(logsumexp(above) - math.log(len(BETS)))


def samples_to_reject_on_zeros(bound: float, level: float) -> int:
    """Terms needed before all-zero terms reject "mean >= bound" at `level` (no test can do with fewer
    than about log(1 / level) / bound): a lower limit for any sample budget."""
    best = max(BETS)
    return math.ceil((math.log(1 / level) + math.log(len(BETS))) / math.log1p(best * bound))
