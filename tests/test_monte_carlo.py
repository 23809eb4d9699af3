"""Monte Carlo kernels for b-min-sep BandMF against enumeration, a log-space reference on the randomness
they drew, and the PLD of Poisson DP-SGD."""

from __future__ import annotations

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from scipy.stats import binom

from madp.accounting.monte_carlo import (
    MinSepProcess,
    hockey_stick,
    log_likelihood_ratio,
    sample_log_ratios,
    sampled_noise,
    sampled_participations,
)


def enumerated_log_ratio(process: MinSepProcess, sigma: float, y: np.ndarray) -> float:
    """log sum_x P(x) N(y; Cx, s^2) / N(y; 0, s^2) over every participation vector x."""
    steps, c = process.steps, np.asarray(process.coefficients)
    strategy = sum(np.diag(np.full(steps - j, c[j]), -j) for j in range(len(c)))
    total = 0.0

    def walk(step, x, probability, available_from):
        nonlocal total
        if step == steps:
            shift = strategy @ np.asarray(x, dtype=float)
            total += probability * np.exp((shift @ y - shift @ shift / 2) / sigma**2)
        elif step < available_from:
            walk(step + 1, x + [0], probability, available_from)
        else:
            for count in range(process.max_contributions + 1):
                walk(
                    step + 1,
                    x + [count],
                    probability * binom.pmf(count, process.max_contributions, process.sampling_prob),
                    step + process.min_sep if count else available_from,
                )

    walk(0, [], 1.0, 0)
    return float(np.log(total))


@pytest.mark.parametrize(
    "steps, min_sep, bands, k", [(8, 2, 2, 1), (9, 3, 2, 2), (10, 1, 1, 1), (7, 3, 3, 2), (12, 4, 3, 1), (6, 2, 1, 3)]
)
def test_recursion_equals_enumeration(steps, min_sep, bands, k):
    rng = np.random.default_rng(steps * 10 + k)
    process = MinSepProcess(steps, min_sep, 0.3, k, tuple(rng.uniform(0.2, 1.0, bands)))
    outputs = rng.normal(0.0, 1.2, (steps, 4))
    expected = [enumerated_log_ratio(process, 0.9, outputs[:, s]) for s in range(4)]
    np.testing.assert_allclose(log_likelihood_ratio(process, 0.9, outputs), expected, rtol=1e-9, atol=1e-9)


def log_space_reference(process: MinSepProcess, sigma: float, outputs: np.ndarray) -> np.ndarray:
    """log f_1 of the recursion in log space, step by step, from the definition of W_i."""
    steps, c = process.steps, np.asarray(process.coefficients)
    padded = np.vstack([outputs, np.zeros((len(c), outputs.shape[1]))])
    norms = np.array([np.sum(c[: steps - i] ** 2) for i in range(steps)])[:, None]
    counts = np.arange(1, process.max_contributions + 1)[:, None, None]
    dots = sum(c[lag] * padded[lag : lag + steps] for lag in range(len(c)))
    log_weight = np.logaddexp.reduce(
        process.count_log_probs[1:, None, None] + (counts * dots - counts**2 * norms / 2) / sigma**2, axis=0
    )
    log_f = np.zeros((steps + process.min_sep, outputs.shape[1]))
    for i in range(steps - 1, -1, -1):
        log_f[i] = np.logaddexp(process.count_log_probs[0] + log_f[i + 1], log_weight[i] + log_f[i + process.min_sep])
    return log_f[0]


CASES = [
    (400, 6, 4, 2, 0.05, 0.6),  # linear space
    (300, 4, 4, 1, 0.01, 0.175),  # a quarter of the samples' dots above the linear path's limit: log space
    (300, 4, 4, 1, 0.01, 0.08),  # log space (sampled: Q's dots straddle the limit)
    (250, 3, 3, 1, 1.0, 0.3),  # s = 0: the log-space path
    (201, 4, 2, 2, 0.7, 0.03),  # extreme weights, s = 0.09
    (131, 1, 1, 1, 0.2, 1.0),
]  # b = 1


@pytest.mark.parametrize("steps, min_sep, bands, k, p, sigma", CASES)
def test_kernel_equals_the_log_space_recursion(steps, min_sep, bands, k, p, sigma):
    process = MinSepProcess(steps, min_sep, p, k, tuple(np.linspace(1.0, 0.3, bands)))
    outputs = np.random.default_rng(1).normal(0.0, sigma, (steps, 2500)) + 0.3
    np.testing.assert_allclose(
        log_likelihood_ratio(process, sigma, outputs),
        log_space_reference(process, sigma, outputs),
        rtol=1e-9,
        atol=1e-9,
    )


def strategy_times(process: MinSepProcess, participations: tuple[np.ndarray, ...], samples: int) -> np.ndarray:
    """C x (T x samples) of the participations (step, sample, records)."""
    shifted = np.zeros((process.steps + len(process.coefficients), samples))
    for step, sample, records in zip(*participations):
        shifted[step : step + len(process.coefficients), sample] += records * np.asarray(process.coefficients)
    return shifted[: process.steps]


@pytest.mark.parametrize("steps, min_sep, bands, k, p, sigma", CASES)
def test_sampled_ratios_are_the_log_space_recursion_at_the_drawn_outputs(steps, min_sep, bands, k, p, sigma):
    """The fused sampler equals the reference at the outputs it drew: sigma z under Q, C x + sigma z under P."""
    process = MinSepProcess(steps, min_sep, p, k, tuple(np.linspace(1.0, 0.3, bands)))
    samples, seed = 600, 11
    noise = sigma * sampled_noise(process, samples, seed)
    participations = sampled_participations(process, samples, seed)
    assert len(participations[0]) > 0
    under_p, under_q = sample_log_ratios(process, sigma, samples, seed)
    np.testing.assert_allclose(under_q, log_space_reference(process, sigma, noise), rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(
        under_p,
        log_space_reference(process, sigma, noise + strategy_times(process, participations, samples)),
        rtol=1e-9,
        atol=1e-9,
    )


def test_samples_are_reproducible_from_the_seed():
    process = MinSepProcess(50, 4, 0.1, 1, (0.8, 0.6))
    first = sample_log_ratios(process, 1.0, 3000, seed=5)
    assert first.shape == (2, 3000)
    assert np.array_equal(first, sample_log_ratios(process, 1.0, 3000, seed=5))
    assert not np.array_equal(first, sample_log_ratios(process, 1.0, 3000, seed=6))
    assert np.array_equal(sample_log_ratios(process, 1.0, 1000, seed=5), first[:, :1000])  # sample n: stream n


def test_directions_share_the_noise_and_do_not_depend_on_each_other():
    """P and Q draw the same z: Q's outputs are z and P's are z + C x / sigma, so a direction drawn alone
    gives the same row, and every P sample without participations has Q's log ratio."""
    process = MinSepProcess(70, 3, 0.02, 1, (0.9, 0.4))
    both = sample_log_ratios(process, 0.7, 2500, seed=8)
    assert np.array_equal(sample_log_ratios(process, 0.7, 2500, seed=8, directions=("P",))[0], both[0])
    assert np.array_equal(sample_log_ratios(process, 0.7, 2500, seed=8, directions=("Q",))[0], both[1])
    _, ids, _ = sampled_participations(process, 2500, seed=8)
    silent = np.setdiff1d(np.arange(2500), ids)  # the samples that never participate
    assert 0 < len(silent) < 2500
    np.testing.assert_array_equal(both[0, silent], both[1, silent])
    assert not np.allclose(both[0, ids], both[1, ids])
    with pytest.raises(ValueError, match="directions"):
        sample_log_ratios(process, 0.7, 10, seed=8, directions=("R",))


@pytest.mark.parametrize("epsilon", [0.5, 1.0, 2.0])
def test_one_band_min_sep_one_is_poisson_dp_sgd(epsilon):
    """b = 1, one band, k_u = 1 is DP-SGD with Poisson sampling: the estimates bracket the PLD delta."""
    steps, q, sigma, samples = 20, 0.1, 1.0, 60_000
    process = MinSepProcess(steps, 1, q, 1, (1.0,))
    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    accountant.compose(
        dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps)
    )
    expected = accountant.get_delta(epsilon)
    ratios = sample_log_ratios(process, sigma, samples, 1)
    estimates = [hockey_stick(row, epsilon, under) for row, under in zip(ratios, ("P", "Q"))]
    (delta, error) = max(estimates)
    assert abs(delta - expected) <= 4 * error + 0.02 * expected, (estimates, expected)


def test_waiting_time_sampler_matches_a_step_by_step_simulation():
    """Participations per sample, records per participation and gaps, against the rule applied step by step."""
    samples = 300_000
    process = MinSepProcess(60, 5, 0.08, 3, (1.0,))
    steps, sample_ids, counts = sampled_participations(process, samples, seed=3)
    per_sample = np.bincount(sample_ids, minlength=samples)
    order = np.lexsort((steps, sample_ids))
    same = sample_ids[order][1:] == sample_ids[order][:-1]
    assert np.diff(steps[order])[same].min() >= 5 and steps.max() < 60

    rng = np.random.default_rng(4)  # the rule, step by step: available -> Binomial(k_u, p) records
    available_from, total, records = np.zeros(samples, int), np.zeros(samples, int), 0
    for step in range(60):
        drawn = rng.binomial(3, 0.08, samples)
        taken = (available_from <= step) & (drawn > 0)
        total += taken
        records += drawn[taken].sum()
        available_from[taken] = step + 5
    difference_error = np.sqrt(per_sample.var() / samples + total.var() / samples)
    assert abs(per_sample.mean() - total.mean()) < 4 * difference_error
    assert counts.mean() == pytest.approx(records / total.sum(), abs=0.003)
