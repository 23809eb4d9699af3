"""What truncating steps to B_max rows (`madp batch --max-batch-size`) costs an amplified guarantee.

Truncated and untruncated training differ only on the event E that some step samples more than
B_max units. Under the fixed-graph zero-out relation E has the same probability rho for both
neighbours (it depends on the graph and the sampling only), so coupling the two runs gives
(epsilon, delta + rho (1 + e^epsilon)). A step's batch is a subset of its Bernoulli(p) sample of
all U units, so rho <= T Pr[Binomial(U, p) > B_max]. The trainer's accounting (`madp train`) and
the planning (`madp recommend-k`, the check of `madp run`) both use these functions, so a B_max the
plan proposes is one calibration accepts.
"""

from __future__ import annotations

import math

from scipy.stats import binom

# Calibration refuses a truncation that takes this share of the target delta or more: the mechanism
# would be left with less than half of it (and a "delta" above 1 is no guarantee, whatever epsilon says).
REFUSED_SHARE = 0.5


def truncation_delta(steps: int, units: int, probability: float, max_batch_size: int, epsilon: float) -> float:
    """The delta that truncating each of `steps` steps to `max_batch_size` rows adds at `epsilon`:
    min(1, T Pr[Binomial(U, p) > B_max]) (1 + e^epsilon)."""
    rho = min(1.0, steps * float(binom.sf(max_batch_size, units, probability)))
    return rho * (1 + math.exp(epsilon))


def smallest_max_batch_size(steps: int, units: int, probability: float, epsilon: float, delta_budget: float) -> int:
    """The smallest B_max >= 1 whose `truncation_delta` is at most `delta_budget` (U at worst: a
    step never holds more than all units, so truncating there costs nothing). The tail only falls
    as B_max grows, so bisection on the integers finds it."""
    if units <= 1 or truncation_delta(steps, units, probability, 1, epsilon) <= delta_budget:
        return 1
    low, high = 1, units  # truncation_delta(low) > budget >= truncation_delta(high) (= 0 at U)
    while high - low > 1:
        middle = (low + high) // 2
        if truncation_delta(steps, units, probability, middle, epsilon) <= delta_budget:
            high = middle
        else:
            low = middle
    return high
