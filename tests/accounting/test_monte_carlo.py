"""Monte Carlo kernels for b-min-sep BandMF against enumeration, a log-space reference on the randomness
they drew, and the PLD of Poisson DP-SGD."""

from __future__ import annotations

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from scipy.stats import binom

from madp.accounting.monte_carlo import (
    FFT_FROM_BANDS,
    DeltaReduction,
    MinSepProcess,
    _draw_log_ratios,
    _kernel,
    delta_reduction,
    hockey_stick,
    hockey_stick_terms,
    log_likelihood_ratio,
    reduced_terms,
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


@pytest.mark.parametrize("steps, bands, k, sigma", [(300, 40, 1, 0.6), (257, 64, 2, 0.9), (90, 50, 1, 0.15)])
def test_fft_dots_give_the_direct_kernels_ratios_on_the_same_draws(steps, bands, k, sigma):
    """From FFT_FROM_BANDS bands the dots are computed by FFT: the same samples as the direct loop, to rounding
    (the last case takes the log-space recursion on some samples)."""
    process = MinSepProcess(steps, bands, 0.05, k, tuple(np.linspace(1.0, 0.2, bands)))
    kernel, seed = _kernel(process, sigma), np.uint64(21)
    by_fft = _draw_log_ratios(kernel, seed, 700, steps, True, True, True, fft=True)
    direct = _draw_log_ratios(kernel, seed, 700, steps, True, True, True, fft=False)
    np.testing.assert_allclose(by_fft, direct, rtol=1e-9, atol=1e-9)
    default = by_fft if bands >= FFT_FROM_BANDS else direct
    np.testing.assert_array_equal(sample_log_ratios(process, sigma, 700, 21, at_least_one=True), default)


def test_participations_given_at_least_one():
    """No participation happens with probability pi_0 = s^T exactly; drawn given >= 1, the first participation
    step follows the geometric law truncated to the horizon, and what follows it is the unconditioned rule."""
    process, samples = MinSepProcess(40, 3, 0.02, 2, (1.0,)), 200_000
    s_to_the_t = binom.pmf(0, 2, 0.02) ** 40
    _, plain_ids, _ = sampled_participations(process, samples, seed=5)
    none = 1 - len(np.unique(plain_ids)) / samples
    assert abs(none - s_to_the_t) < 4 * np.sqrt(s_to_the_t * (1 - s_to_the_t) / samples)

    steps, ids, _ = sampled_participations(process, samples, seed=6, at_least_one=True)
    assert np.array_equal(np.unique(ids), np.arange(samples))  # every sample participates
    order = np.lexsort((steps, ids))
    first = steps[order][np.r_[True, ids[order][1:] != ids[order][:-1]]]
    s = binom.pmf(0, 2, 0.02)
    law = s ** np.arange(40) * (1 - s) / (1 - s**40)
    observed = np.bincount(first, minlength=40)
    chi_square = ((observed - samples * law) ** 2 / (samples * law)).sum()
    assert chi_square < 80  # 39 degrees of freedom: 80 is p ~ 1e-4
    later = np.bincount(ids, minlength=samples) - 1  # participations after the first, per sample
    _, reference_ids, _ = sampled_participations(MinSepProcess(40, 3, 0.02, 2, (1.0,)), samples, seed=7)
    assert later.mean() < np.bincount(reference_ids, minlength=samples).mean()  # fewer steps left after it


def quadrature_deltas(process: MinSepProcess, sigma: float, epsilon: float, points: int = 120) -> dict:
    """delta(P || Q), delta(Q || P) and E_P1[(1 - e^(eps - L))_+] (P given >= 1 participation) by the midpoint
    rule over a grid of outputs, with the participation vectors and their probabilities enumerated."""
    steps, c = process.steps, np.asarray(process.coefficients)
    strategy = sum(np.diag(np.full(steps - j, c[j]), -j) for j in range(len(c)))
    vectors = []

    def walk(step, x, probability, available_from):
        if step == steps:
            vectors.append((strategy @ np.asarray(x, float), probability))
        elif step < available_from:
            walk(step + 1, x + [0], probability, available_from)
        else:
            for count in range(process.max_contributions + 1):
                chance = binom.pmf(count, process.max_contributions, process.sampling_prob)
                walk(step + 1, x + [count], probability * chance, step + process.min_sep if count else available_from)

    walk(0, [], 1.0, 0)
    axis = np.linspace(-7 * sigma, 7 * sigma + c.sum() * process.max_contributions, points + 1)
    centers, width = (axis[1:] + axis[:-1]) / 2, axis[1] - axis[0]
    outputs = np.stack(np.meshgrid(*[centers] * steps, indexing="ij")).reshape(steps, -1)

    def density(shift):
        return np.exp(-np.sum((outputs - shift[:, None]) ** 2, axis=0) / (2 * sigma**2)) / (2 * np.pi * sigma**2) ** (
            steps / 2
        )

    q = density(np.zeros(steps))
    p = sum(probability * density(shift) for shift, probability in vectors)
    none = vectors[0][1]  # the all-zero vector comes first
    loss = log_likelihood_ratio(process, sigma, outputs)
    g_p, g_q = np.clip(-np.expm1(epsilon - loss), 0, None), np.clip(-np.expm1(epsilon + loss), 0, None)
    volume = width**steps
    return {
        "P": float((p * g_p).sum() * volume),
        "Q": float((q * g_q).sum() * volume),
        "P1": float(((p - none * q) * g_p).sum() * volume / (1 - none)),
        "mass": float(p.sum() * volume),
        "min_loss": float(loss.min()),
        "none": none,
    }


@pytest.mark.parametrize("epsilon, sigma", [(0.15, 0.7), (0.6, 0.7), (2.5, 0.4)])
def test_delta_reduction_against_quadrature_and_plain_monte_carlo(epsilon, sigma):
    """DeltaReduction's bounds hold on the exact deltas (quadrature over every output, every participation
    vector enumerated), and Monte Carlo on P given >= 1 participation, weighted, estimates them as plain
    Monte Carlo on P does, with a smaller standard error for the same samples."""
    process = MinSepProcess(3, 2, 0.1, 1, (1.0, 0.5))
    exact = quadrature_deltas(process, sigma, epsilon)
    assert exact["mass"] == pytest.approx(1.0, abs=1e-6)
    assert exact["none"] == pytest.approx(0.9**3)
    assert exact["min_loss"] >= np.log(exact["none"]) - 1e-12  # P >= pi_0 Q
    p_bound, q_bound = delta_reduction(process, epsilon, "P"), delta_reduction(process, epsilon, "Q")
    given_up = 1 - exact["none"] * np.exp(-epsilon)
    weight = (1 - exact["none"]) / given_up  # the bound on P, which delta_reduction uses where given_up >= 0.9
    assert exact["P"] <= weight * exact["P1"] <= exact["P"] / given_up
    expected = (weight, 1.0, True) if given_up >= 0.9 else (1.0, 1.0, False)
    assert p_bound.at_least_one == expected[2] and p_bound[:2] == pytest.approx(expected[:2], rel=1e-12)
    assert exact["Q"] <= q_bound.weight
    if epsilon >= -np.log(exact["none"]):  # 0.316: delta(Q || P) = 0 exactly, certified without samples
        assert q_bound.weight == 0 and exact["Q"] == 0 and q_bound.certified(0.0)
    else:
        assert 0 < exact["Q"] < q_bound.weight < 1

    samples = 400_000
    plain = hockey_stick_terms(sample_log_ratios(process, sigma, samples, 3, ("P",))[0], epsilon, "P")
    assert abs(plain.mean() - exact["P"]) < 4 * plain.std() / np.sqrt(samples) + 2e-4 * exact["P"]
    given_one = sample_log_ratios(process, sigma, samples, 4, ("P", "Q"), at_least_one=True)
    reduced = weight * reduced_terms(given_one[0], epsilon, "P", DeltaReduction(weight, 1.0, True))
    assert abs(reduced.mean() - weight * exact["P1"]) < 4 * reduced.std() / np.sqrt(samples)
    if p_bound.at_least_one:  # the weighted terms vary less than plain ones: about weight times the variance
        assert reduced.var() < 0.5 * plain.var()
    if q_bound.weight > 0:
        q_terms = q_bound.weight * reduced_terms(given_one[1], epsilon, "Q", q_bound)
        assert abs(q_terms.mean() - exact["Q"]) < 4 * q_terms.std() / np.sqrt(samples) + 2e-4 * exact["Q"]
