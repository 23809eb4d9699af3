"""DP-SGD accounting against dp_accounting events built here independently, plus theory's shape."""

from __future__ import annotations

import json
import math

import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from scipy.optimize import brentq
from scipy.stats import binom, norm

from madp.accounting.calibrate import (
    DISCRETIZATION,
    Unaccountable,
    calibrate,
    epsilon,
    finite_epsilon,
    smallest_noise_ratio,
)
from madp.accounting.mechanisms import DpSgd, DpSgdUls
from madp.cli import main
from madp.core.errors import InputError


def pld(event, discretization=DISCRETIZATION):
    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=discretization)
    accountant.compose(event)
    return accountant


def poisson_gaussian(q, sigma, steps):
    return dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps)


@pytest.mark.slow
@pytest.mark.parametrize("sigma", [0.8, 1.2, 3.0])
def test_one_record_per_user_is_the_poisson_sampled_gaussian(sigma):
    expected = pld(poisson_gaussian(0.02, sigma, 300)).get_epsilon(1e-5)
    assert epsilon(DpSgd(0.02, 300, 1), sigma, 1e-5) == pytest.approx(expected, rel=2e-3)
    assert epsilon(DpSgdUls(0.02, 300), sigma, 1e-5) == pytest.approx(expected, rel=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("k", [2, 4])
def test_k_records_match_the_mixture_of_gaussians_composed_directly(k):
    q, sigma, steps = 0.01, 1.5, 500
    mixture = dp_event.MixtureOfGaussiansDpEvent(sigma, list(range(k + 1)), list(binom.pmf(range(k + 1), k, q)))
    expected = pld(dp_event.SelfComposedDpEvent(mixture, steps)).get_epsilon(1e-6)
    assert epsilon(DpSgd(q, steps, k), sigma, 1e-6) == pytest.approx(expected, rel=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("k", [2, 3])
def test_never_worse_than_group_privacy(k):
    """Group privacy turns (e1, d1) per record into (k e1, k e^((k-1) e1) d1) per user."""
    q, sigma, steps = 0.02, 1.0, 50
    per_record = pld(poisson_gaussian(q, sigma, steps))
    per_user = pld(DpSgd(q, steps, k).event(sigma))
    for e1 in (0.5, 1.0, 2.0):
        group_delta = k * math.exp((k - 1) * e1) * per_record.get_delta(e1)
        assert per_user.get_delta(k * e1) <= group_delta
    assert epsilon(DpSgd(q, steps, k), sigma, 1e-5) > epsilon(DpSgd(q, steps, 1), sigma, 1e-5)


@pytest.mark.slow
def test_a_tiny_sigma_is_accounted_on_a_wider_grid_that_still_bounds_epsilon():
    """Below a noise-to-sensitivity ratio of 0.1 the PLD grid widens as 1 / ratio^2: 1000 steps at
    sigma 1e-3 are accounted in bounded memory (on the fixed grid one step alone outgrew any memory),
    and at 0.05 the wider grid's bound (each grid's is an upper bound) is the fixed grid's to 1e-6.
    The ratio is read from the event: sigma over the mixture's largest sensitivity, through sampling
    and composition."""
    q, steps, delta = 0.01, 1000, 1e-6
    assert smallest_noise_ratio(DpSgd(q, steps, 4).event(0.2)) == pytest.approx(0.05)
    composed = dp_event.ComposedDpEvent([poisson_gaussian(q, 0.5, 3), dp_event.GaussianDpEvent(0.3)])
    assert smallest_noise_ratio(composed) == 0.3 and smallest_noise_ratio(dp_event.NoOpDpEvent()) == math.inf
    fine = pld(poisson_gaussian(q, 0.05, steps)).get_epsilon(delta)
    assert epsilon(DpSgdUls(q, steps), 0.05, delta) == pytest.approx(fine, rel=1e-6)
    tiny = finite_epsilon(DpSgdUls(q, steps), 1e-3, delta)
    assert fine < tiny < 1e9


@pytest.mark.slow
def test_an_event_the_accountant_cannot_build_is_named_and_calibration_stops_above_it(capsys):
    """dp_accounting fails to build a mixture of Gaussians at q = 1e-9 below sigma 0.05 (a ValueError
    deep inside it) or of 100,000 contributions (an OverflowError): epsilon names the mechanism and
    sigma instead, and calibration, which searches down while the target is met, keeps the smallest
    sigma the accountant did account."""
    mechanism = DpSgd(1e-9, 1000, 1)
    with pytest.raises(Unaccountable, match="cannot account dpsgd at noise_multiplier 0.03"):
        epsilon(mechanism, 0.03, 1e-6)
    result = calibrate(mechanism, 8.0, 1e-6)
    assert result.noise_multiplier > 0.03 and result.epsilon <= 8.0
    assert epsilon(mechanism, result.noise_multiplier, 1e-6) == result.epsilon
    with pytest.raises(Unaccountable, match="OverflowError.*lower max_contributions or steps$"):  # math range error
        epsilon(DpSgd(0.01, 1000, 100_000), 1.0, 1e-6)
    dpsgd = ["--mechanism", "dpsgd", "--sampling-prob", "1e-9", "--steps", "1000", "--delta", "1e-6"]
    assert main(["-q", "epsilon", *dpsgd, "--noise-multiplier", "0.03"]) == 2  # the command line names its flags
    said = capsys.readouterr().err
    remedy = "raise --noise-multiplier or the sampling probability, or lower --max-contributions or --steps"
    assert said.startswith("madp epsilon: error: the PLD accountant cannot account dpsgd at --noise-multiplier 0.03 ")
    assert said.endswith(f"; {remedy}\n")


@pytest.mark.slow
def test_an_epsilon_asked_again_is_not_accounted_again(monkeypatch):
    """A privacy loss distribution is built once per process for a mechanism, sigma, delta and grid (a
    training's composition is computed as its step is made and again as it enters the ledger; calibrations
    of one mechanism evaluate the same sigmas); anything else is another one, and a failure is raised again."""
    built = []
    compose = pld_privacy_accountant.PLDAccountant.compose

    def counted(self, event, *args, **kwargs):
        built.append(event)
        return compose(self, event, *args, **kwargs)

    monkeypatch.setattr(pld_privacy_accountant.PLDAccountant, "compose", counted)
    first = epsilon(DpSgdUls(0.0123, 17), 1.1, 1e-5)
    assert epsilon(DpSgdUls(0.0123, 17), 1.1, 1e-5) == first and len(built) == 1
    assert epsilon(DpSgdUls(0.0123, 17), 1.2, 1e-5) < first and len(built) == 2
    assert epsilon(DpSgdUls(0.0123, 18), 1.1, 1e-5) > first and len(built) == 3
    assert epsilon(DpSgdUls(0.0123, 17), 1.1, 1e-6) > first and len(built) == 4
    assert epsilon(DpSgdUls(0.0123, 17), 1.1, 1e-5, discretization=1e-2) >= first and len(built) == 5
    for _ in range(2):
        with pytest.raises(Unaccountable, match="cannot account dpsgd at noise_multiplier 0.031"):
            epsilon(DpSgd(1e-9, 999, 1), 0.031, 1e-6)
    assert len(built) == 7


def exact_gaussian_epsilon(mu: float, delta: float) -> float:
    """The exact epsilon at `delta` of the Gaussian mechanism whose sensitivity is `mu` times its noise
    (Balle and Wang 2018, Thm. 8): delta(eps) = Phi(mu/2 - eps/mu) - e^eps Phi(-mu/2 - eps/mu), solved for
    eps; the second term in log space, where e^eps alone overflows."""

    def excess(eps: float) -> float:
        return norm.cdf(mu / 2 - eps / mu) - math.exp(eps + norm.logcdf(-mu / 2 - eps / mu)) - delta

    return brentq(excess, 0.0, mu * mu + 10 * mu, xtol=1e-12)


@pytest.mark.parametrize(
    ("k", "steps", "sigma"), [(4, 5, 0.5285933102414113), (1, 5, 0.8096258668682517), (4, 20, 20.0), (2, 300, 6.0)]
)
def test_every_record_in_every_step_is_the_gaussian_mechanism_composed(k, steps, sigma):
    """At q = 1 no step samples: T Gaussian mechanisms of sensitivity k and noise sigma, whose privacy losses
    compose exactly into that of one Gaussian of sensitivity sqrt(T) k. The PLD's epsilon is that one's, at
    most a grid step above (pessimistic), on the plan's grid and the curve's. (dp_accounting's mixture of
    Gaussians at q = 1 failed with a TypeError at the first two sigmas: its tail search returned None.)"""
    exact = exact_gaussian_epsilon(math.sqrt(steps) * k / sigma, 1e-5)
    for grid in (DISCRETIZATION, 1e-2):
        assert exact <= epsilon(DpSgd(1.0, steps, k), sigma, 1e-5, grid) <= exact + grid


def test_a_search_that_fails_inside_the_accountant_is_named():
    """Within 1e-15 of q = 1 the mixture keeps a second sensitivity, and dp_accounting's tail search still
    starts on its answer at some sigmas and fails on the None it returns (a TypeError): named, as the
    accountant's other failures are, never a traceback."""
    failed = r"cannot account dpsgd at noise_multiplier 0.528593 \(dp_accounting: TypeError: unsupported operand"
    with pytest.raises(Unaccountable, match=failed):
        epsilon(DpSgd(1 - 2**-53, 5, 4), 0.5285933102414113, 1e-5)


@pytest.mark.slow
def test_calibration_meets_the_target_tightly():
    mechanism = DpSgd(0.02, 100, 2)
    result = calibrate(mechanism, 1.0, 1e-5)
    assert result.epsilon <= 1.0 and epsilon(mechanism, result.noise_multiplier, 1e-5) <= 1.0
    assert epsilon(mechanism, result.noise_multiplier / 1.002, 1e-5) > 1.0, "a smaller sigma must miss the target"


@pytest.mark.slow
def test_sigma_moves_as_theory_says():
    base = dict(sampling_prob=0.02, steps=50, max_contributions=1)
    # Every change below moves sigma by far more than the 2% tolerance.

    def sigma(eps=1.0, **change):
        return calibrate(
            DpSgd(**{**base, **change}), eps, 1e-5, relative_tolerance=0.02, discretization=1e-2
        ).noise_multiplier

    reference = sigma()
    assert sigma(eps=2.0) < reference < sigma(eps=0.5)
    assert sigma(steps=400) > reference
    assert sigma(sampling_prob=0.05) > reference
    assert sigma(max_contributions=3) > reference


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: DpSgd(0.0, 10), "sampling_prob"),
        (lambda: DpSgd(1.5, 10), "sampling_prob"),
        (lambda: DpSgd(0.1, 0), "steps"),
        (lambda: DpSgd(0.1, 10, 0), "max_contributions"),
        (lambda: DpSgdUls(0.1, 2.5), "steps"),
        (lambda: calibrate(DpSgd(0.1, 10), 0.0, 1e-5), "epsilon"),
        (lambda: calibrate(DpSgd(0.1, 10), 1.0, 1.0), "delta"),
        (lambda: epsilon(DpSgd(0.1, 10), 0.0, 1e-5), "noise_multiplier"),
        (lambda: calibrate(DpSgd(1.0, 10), 1e-3, 1e-12), "unreachable"),
        # below the delta the accountant resolves, epsilon is infinite: `madp epsilon` printed "Infinity"
        (lambda: finite_epsilon(DpSgd(0.01, 100), 1.0, 1e-16), "no finite epsilon .* delta 1e-16"),
        # a tolerance of 0 or below, or NaN, never ended the bisection (or ended it at once)
        *((lambda t=t: calibrate(DpSgd(0.1, 10), 1.0, 1e-5, t), "tolerance") for t in (0.0, -1.0, math.nan, 1.0)),
    ],
)
@pytest.mark.slow
def test_clear_errors(build, message):
    """A Python caller's error names the parameter; the command line's names its flag
    (test_the_command_line_names_the_flags)."""
    with pytest.raises(InputError, match=message):
        build()


@pytest.mark.slow
def test_cli_calibrate_then_epsilon(capsys):
    assert (
        main(
            [
                "-q",
                "calibrate",
                "--mechanism",
                "dpsgd",
                "--epsilon",
                "0.5",
                "--delta",
                "1e-5",
                "--steps",
                "60",
                "--batch-size",
                "100",
                "--dataset-size",
                "20000",
                "-k",
                "2",
                "--tolerance",
                "0.01",
            ]
        )
        == 0
    )
    calibrated = json.loads(capsys.readouterr().out)
    assert calibrated["sampling_prob"] == 0.005 and calibrated["max_contributions"] == 2
    assert (
        main(
            [
                "-q",
                "epsilon",
                "--mechanism",
                "dpsgd",
                "--noise-multiplier",
                str(calibrated["noise_multiplier"]),
                "--delta",
                "1e-5",
                "--steps",
                "60",
                "--sampling-prob",
                "0.005",
                "-k",
                "2",
            ]
        )
        == 0
    )
    checked = json.loads(capsys.readouterr().out)
    assert checked["epsilon"] == pytest.approx(calibrated["epsilon"]) and checked["epsilon"] <= 0.5
    assert main(["-q", "calibrate", "--mechanism", "dpsgd", "--epsilon", "2", "--delta", "1e-5", "--steps", "3"]) == 2
    assert "--sampling-prob" in capsys.readouterr().err


@pytest.mark.parametrize(
    "arguments, said",
    [
        (["calibrate", "--epsilon", "2", "--steps", "0", "--sampling-prob", "0.1"], "--steps must be an integer >= 1"),
        (["epsilon", "--noise-multiplier", "0", "--steps", "3", "--sampling-prob", "0.1"], "--noise-multiplier must"),
        (["calibrate", "--epsilon", "2", "--steps", "3", "--sampling-prob", "0.1", "--tolerance", "0"], "--tolerance"),
    ],
)
def test_the_command_line_names_the_flags(arguments, said, capsys):
    """The accountant's errors name its parameters (test_clear_errors); `madp calibrate` and `madp epsilon`
    say them as the flags their user typed."""
    assert main(["-q", *arguments, "--mechanism", "dpsgd", "--delta", "1e-5"]) == 2
    assert said in capsys.readouterr().err


def test_cli_warns_when_delta_exceeds_one_over_population(capsys, caplog):
    main(
        [
            "epsilon",
            "--mechanism",
            "dpsgd-uls",
            "--noise-multiplier",
            "2",
            "--delta",
            "0.05",
            "--steps",
            "10",
            "--cohort-size",
            "5",
            "--num-users",
            "100",
        ]
    )
    assert "delta 0.05 exceeds 1/100" in caplog.text
