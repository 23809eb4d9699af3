"""One-run privacy auditing: from an auditor's guesses about m canaries to a lower bound on epsilon.

Each of m canaries is included independently with probability 1/2; the auditor guesses
"included" (+1), "excluded" (-1) or abstains (0) for each from the trained model alone. If the
training is (epsilon, delta)-DP with respect to every canary, then r guesses are correct at least v
times with probability at most

    P[Binomial(r, q) >= v] + 2 m delta max_{1 <= i <= v} P[v - i <= Binomial(r, q) < v] / i,
    q = e^epsilon / (1 + e^epsilon)

(Steinke, Nasr and Jagielski 2023, "Privacy auditing with one (1) training run", main theorem
and its Appendix D procedure). The lower bound at confidence c is the largest epsilon whose
p-value is still below 1 - c: a claim of that epsilon (or less) at that delta is refuted with
confidence c.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np
from scipy.stats import binom

from madp.core.errors import InputError, OptionError

_BISECTIONS = 60
_EPSILON_CEILING = 100.0  # no audit of m < 1e40 canaries can refute more


def p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """Probability of v or more correct guesses out of r under (epsilon, delta)-DP (the bound above)."""
    if not 0 <= v <= r <= m:
        raise InputError(f"auditing needs 0 <= correct ({v}) <= guesses ({r}) <= canaries ({m})")
    if epsilon < 0 or not 0 <= delta <= 1:
        raise InputError(f"auditing needs epsilon >= 0 and delta in [0, 1], got ({epsilon}, {delta})")
    q = 1.0 / (1.0 + np.exp(-epsilon))
    tail = float(binom.sf(v - 1, r, q))
    if delta == 0 or v == 0:
        return min(tail, 1.0)
    below = np.cumsum(binom.pmf(v - np.arange(1, v + 1), r, q))  # P[v - i <= Bin < v], i = 1..v
    slack = float(np.max(below / np.arange(1, v + 1)))
    return min(tail + 2.0 * m * delta * slack, 1.0)


def epsilon_lower_bound(m: int, r: int, v: int, delta: float, confidence: float) -> float:
    """The largest epsilon that v correct out of r guesses on m canaries refute at `confidence` (0 if none)."""
    if not 0 < confidence < 1:
        raise OptionError("{confidence} must be in (0, 1), got {0}", confidence)
    level = 1.0 - confidence
    if p_value(m, r, v, 0.0, delta) >= level:
        return 0.0
    low, high = 0.0, _EPSILON_CEILING  # p_value grows with epsilon: keep p(low) < level <= p(high)
    for _ in range(_BISECTIONS):
        middle = (low + high) / 2
        if p_value(m, r, v, middle, delta) < level:
            low = middle
        else:
            high = middle
    return low


def guesses(scores: np.ndarray, included_guesses: int, excluded_guesses: int) -> np.ndarray:
    """+1 for the `included_guesses` highest scores, -1 for the `excluded_guesses` lowest, 0 (abstain) otherwise;
    ties broken by position, so the guesses depend on the scores alone."""
    order = np.argsort(-np.asarray(scores, dtype=np.float64), kind="stable")
    if included_guesses + excluded_guesses > len(order):
        raise InputError(f"{included_guesses} + {excluded_guesses} guesses exceed the {len(order)} canaries")
    result = np.zeros(len(order), dtype=np.int8)
    result[order[:included_guesses]] = 1
    result[order[len(order) - excluded_guesses :]] = -1
    return result


class Candidate(NamedTuple):
    """One guess plan an audit tried: its included and excluded guesses, how many were correct, and the
    lower bound on epsilon they prove."""

    included_guesses: int
    excluded_guesses: int
    correct: int  # v
    epsilon_lower_bound: float

    @property
    def guesses(self) -> int:
        """r: the plan's guesses, both ways."""
        return self.included_guesses + self.excluded_guesses

    def to_json(self) -> dict[str, Any]:
        """As audit.json lists it."""
        return self._asdict()


@dataclasses.dataclass(frozen=True)
class AuditResult:
    canaries: int
    guesses: int  # r: the guess count that gave the best bound
    correct: int  # v
    epsilon_lower_bound: float
    confidence: float
    delta: float
    candidates: tuple[Candidate, ...]  # every guess plan tried, with its correct guesses and bound
    measurable: float  # the bound had every guess been right: no larger epsilon can be refuted


GUESS_FRACTIONS = (0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


def guess_plans(m: int) -> tuple[tuple[int, int], ...]:
    """(included, excluded) guess counts an audit tries, fixed before any score is seen: r in 2%, 5%, 10%,
    20%, 50% and 100% of m, split evenly, or all "excluded" (a model that has not learned a canary gives
    it a high loss, while a low loss may be luck), or all "included"."""
    plans = set()
    for r in {max(2, min(m, round(m * f))) for f in GUESS_FRACTIONS}:
        plans |= {(r // 2, r - r // 2), (0, r), (r, 0)}
    return tuple(sorted(plans))


def one_run_audit(scores: np.ndarray, included: np.ndarray, delta: float, confidence: float) -> AuditResult:
    """The best lower bound over `guess_plans(m)`, each taken at confidence 1 - (1 - c) / |plans|
    (Bonferroni), so that the maximum over plans holds at confidence c. `scores`: higher means
    "more likely included"."""
    included = np.asarray(included, dtype=bool)
    m = len(included)
    if m < 2 or len(scores) != m:
        raise InputError(f"an audit needs at least 2 canaries and one score each (got {m} and {len(scores)})")
    plans = guess_plans(m)
    each = 1.0 - (1.0 - confidence) / len(plans)
    truth = np.where(included, 1, -1)
    candidates = []
    for plus, minus in plans:
        v = int(np.sum(guesses(scores, plus, minus) == truth))
        candidates.append(Candidate(plus, minus, v, epsilon_lower_bound(m, plus + minus, v, delta, each)))
    best = max(candidates, key=lambda candidate: candidate.epsilon_lower_bound)
    measurable = max(epsilon_lower_bound(m, r, r, delta, each) for r in {plus + minus for plus, minus in plans})
    return AuditResult(
        canaries=m,
        guesses=int(best.guesses),
        correct=int(best.correct),
        epsilon_lower_bound=best.epsilon_lower_bound,
        confidence=confidence,
        delta=delta,
        candidates=tuple(candidates),
        measurable=measurable,
    )
