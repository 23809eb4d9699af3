"""BandMF strategies and the unamplified BandMF accountant, against dense and brute-force computations."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant

from madp.accounting.calibrate import DISCRETIZATION, epsilon
from madp.accounting.mechanisms import BandMf
from madp.accounting.strategies import coefficients, optimized_coefficients, prefix_sum_mse, sqrt_coefficients
from madp.cli import main
from madp.core.errors import InputError


def dense(bands: np.ndarray, steps: int) -> np.ndarray:
    return sum(np.diag(np.full(steps - j, bands[j]), -j) for j in range(min(len(bands), steps)))


def test_untruncated_square_root_squares_to_prefix_sums():
    steps = 9
    c = dense(sqrt_coefficients(steps), steps)
    product = c @ c
    np.testing.assert_allclose(product / product[0, 0], np.tril(np.ones((steps, steps))), atol=1e-12)
    assert np.linalg.norm(sqrt_coefficients(4)) == pytest.approx(1.0)


@pytest.mark.parametrize("steps, bands", [(10, 3), (17, 1), (12, 12), (30, 5)])
def test_prefix_sum_mse_matches_the_dense_definition(steps, bands):
    rng = np.random.default_rng(steps)
    c = np.concatenate([[1.0], rng.uniform(0.0, 0.6, bands - 1)])
    strategy = dense(c, steps)
    decoder = np.tril(np.ones((steps, steps))) @ np.linalg.inv(strategy)
    expected = (decoder**2).sum() / steps * np.linalg.norm(strategy, axis=0).max() ** 2
    assert prefix_sum_mse(c, steps) == pytest.approx(expected, rel=1e-10)


def test_optimized_strategy_lowers_the_error():
    # About 20-25% below the banded square root at T = 1000, b = 8 (measured 21.5%).
    for steps, bands, at_most in [(1000, 8, 0.8), (300, 4, 0.9)]:
        sqrt_mse = prefix_sum_mse(sqrt_coefficients(bands), steps)
        optimized = optimized_coefficients(steps, bands)
        assert np.linalg.norm(optimized) == pytest.approx(1.0)
        assert prefix_sum_mse(optimized, steps) < at_most * sqrt_mse
    assert coefficients("optimized", 50, 1).tolist() == [1.0]


def brute_force_sensitivity(bands: np.ndarray, steps: int, min_sep: int, k: int) -> float:
    """max ||C x|| over participation vectors with at most k ones at least min_sep apart."""
    strategy, best = dense(bands, steps), 0.0
    for count in range(1, k + 1):
        for steps_taken in itertools.combinations(range(steps), count):
            if all(b - a >= min_sep for a, b in zip(steps_taken, steps_taken[1:])):
                x = np.zeros(steps)
                x[list(steps_taken)] = 1.0
                best = max(best, float(np.linalg.norm(strategy @ x)))
    return best


@pytest.mark.parametrize("bands, min_sep, k", [(3, 3, 2), (3, 5, 3), (1, 1, 4), (4, 4, 1), (4, 4, 3), (2, 6, 2)])
def test_bandmf_sensitivity_and_epsilon(bands, min_sep, k):
    steps = 12
    c = optimized_coefficients(steps, bands)
    mechanism = BandMf(steps, min_sep, k, tuple(c))
    sensitivity = brute_force_sensitivity(c, steps, min_sep, k)
    assert mechanism.sensitivity == pytest.approx(sensitivity, rel=1e-12)
    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=DISCRETIZATION)
    accountant.compose(dp_event.GaussianDpEvent(2.0 / sensitivity))
    assert epsilon(mechanism, 2.0, 1e-5) == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-12)


def test_one_band_every_step_is_full_batch_dp_sgd():
    mechanism = BandMf(50, 1, 50, (1.0,))
    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=DISCRETIZATION)
    accountant.compose(dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(7.0), 50))
    assert epsilon(mechanism, 7.0, 1e-6) == pytest.approx(accountant.get_epsilon(1e-6), rel=1e-3)


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: BandMf(100, 4, 2, tuple(sqrt_coefficients(8))), "must not exceed min_sep"),
        (lambda: BandMf(100, 10, 11, (1.0,)), r"^max_participations must be an integer in \[1, 10\]"),
        (lambda: BandMf(100, 0, 1, (1.0,)), "^min_sep must be an integer >= 1"),
        (lambda: coefficients("sqrt", 10, 11), r"^bands must be an integer in \[1, steps\], got 11$"),
        (lambda: coefficients("sqrt", 0, 1), r"^steps must be an integer in \[1, 2\^63\), got 0$"),
        (lambda: coefficients("magic", 10, 2), r"^strategy must be one of \('sqrt', 'optimized'\), got 'magic'$"),
        # arrays of 10^12 steps: refused before allocating (was numpy's MemoryError traceback)
        (lambda: coefficients("optimized", 10**12, 8), r"--steps 1000000000000: the prefix-sum MSE .* GiB"),
        (lambda: prefix_sum_mse(sqrt_coefficients(8), 10**12), "use fewer --steps"),
    ],
)
def test_bandmf_errors(build, message):
    with pytest.raises(InputError, match=message):
        build()


def test_cli_strategy_and_bandmf(capsys):
    assert main(["-q", "strategy", "--steps", "200", "--bands", "4", "--strategy", "optimized"]) == 0
    strategy = json.loads(capsys.readouterr().out)
    assert len(strategy["coefficients"]) == 4 and strategy["prefix_sum_mse"] < strategy["sqrt_prefix_sum_mse"]
    assert (
        main(
            [
                "-q",
                "calibrate",
                "--mechanism",
                "bandmf",
                "--epsilon",
                "1",
                "--delta",
                "1e-5",
                "--steps",
                "200",
                "--bands",
                "4",
                "--min-sep",
                "20",
                "--max-participations",
                "10",
                "--strategy",
                "optimized",
            ]
        )
        == 0
    )
    calibrated = json.loads(capsys.readouterr().out)
    assert calibrated["coefficients"] == pytest.approx(strategy["coefficients"])
    assert calibrated["epsilon"] <= 1.0 and calibrated["strategy"] == "optimized"
    assert (
        main(
            [
                "-q",
                "epsilon",
                "--mechanism",
                "bandmf",
                "--noise-multiplier",
                "1",
                "--delta",
                "1e-5",
                "--steps",
                "200",
                "--bands",
                "4",
            ]
        )
        == 2
    )
    assert "bandmf needs --bands, --min-sep and --max-participations" in capsys.readouterr().err
    assert main(["-q", "strategy", "--steps", "10", "--bands", "11"]) == 2
    assert "madp strategy: error: --bands must be an integer in [1, --steps], got 11\n" in capsys.readouterr().err


def test_cyclic_poisson_bandmf():
    from madp.accounting.mechanisms import BandMfCyclic

    # One subset and one band: DP-SGD with Poisson sampling.
    poisson = pld_privacy_accountant.PLDAccountant(value_discretization_interval=DISCRETIZATION)
    poisson.compose(
        dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(0.05, dp_event.GaussianDpEvent(1.3)), 40)
    )
    assert epsilon(BandMfCyclic(0.05, 40, 1, (1.0,)), 1.3, 1e-5) == pytest.approx(poisson.get_epsilon(1e-5), rel=1e-9)
    # b subsets: ceil(T / b) chances, each a Poisson-sampled Gaussian at sigma / (column norm).
    c = sqrt_coefficients(4)
    cyclic = pld_privacy_accountant.PLDAccountant(value_discretization_interval=DISCRETIZATION)
    cyclic.compose(
        dp_event.SelfComposedDpEvent(
            dp_event.PoissonSampledDpEvent(0.2, dp_event.GaussianDpEvent(1.3 / np.linalg.norm(c))), 11
        )
    )
    assert epsilon(BandMfCyclic(0.2, 41, 4, tuple(c)), 1.3, 1e-5) == pytest.approx(cyclic.get_epsilon(1e-5), rel=1e-9)
    with pytest.raises(InputError, match="must not exceed min_sep"):
        BandMfCyclic(0.2, 41, 3, tuple(c))
