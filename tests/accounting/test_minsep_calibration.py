"""Estimate-verify-release calibration of BandMF with b-min-sep sampling (Algorithm 5)."""

from __future__ import annotations

import dataclasses
import functools
import json
import math

import pytest

import madp.accounting.evr as evr
import madp.accounting.mc_delta as mc_delta
from madp.accounting.betting import samples_to_reject_on_zeros
from madp.accounting.calibrate import calibrate, epsilon
from madp.accounting.evr import RUNG_STEPS
from madp.accounting.mechanisms import DpSgdUls
from madp.accounting.monte_carlo import MinSepProcess
from madp.cli import main
from madp.core.errors import InputError
from madp.core.options import flag_of

POISSON = MinSepProcess(30, 1, 0.1, 1, (1.0,))  # b = 1, one band, k_u = 1: DP-SGD with Poisson sampling


EVERY_STEP = DpSgdUls(1.0, 30)  # POISSON's participations without amplification


def fallback_sigma(target_epsilon: float, delta: float) -> float:
    return calibrate(EVERY_STEP, target_epsilon, delta).noise_multiplier


@pytest.mark.slow
def test_released_sigma_is_private_by_the_exact_poisson_accountant():
    result = evr.calibrate_minsep(POISSON, 1.0, 0.02, seed=3, fallback=EVERY_STEP)
    assert result.verified and result.overall_delta <= 0.02
    exact = calibrate(DpSgdUls(0.1, 30), 1.0, 0.02).noise_multiplier  # the same PLD as dpsgd with k = 1
    assert exact <= result.value < 1.5 * exact
    assert epsilon(DpSgdUls(0.1, 30), result.value, 0.02) <= 1.0


@pytest.mark.slow
def test_same_result_for_any_number_of_workers():
    runs = [
        evr.calibrate_minsep(MinSepProcess(40, 3, 0.08, 2, (0.8, 0.6)), 2.0, 0.02, seed=1, workers=w) for w in (1, 2)
    ]
    assert [run.attempts for run in runs] == [1, 2], "the ledger counts every run of the same calibration"
    assert runs[0] == dataclasses.replace(runs[1], attempts=1)


def test_fallback_is_released_when_no_candidate_verifies(monkeypatch):
    monkeypatch.setattr(evr, "estimate_passes", lambda *args: (True, None))  # a wrong estimate: every sigma passes
    # The bracket then sinks to fallback * 1e-6, and every candidate is far below the ~1.2 that Poisson
    # DP-SGD needs here: each must fail verification, and early (the evidence against it is overwhelming).
    result = evr.calibrate_minsep(POISSON, 1.0, 0.02, samples=100_000, seed=3, fallback=EVERY_STEP)
    assert result.ladder[-1] < 0.01
    assert not result.verified and result.value == result.fallback
    assert result.outcomes == (False,) * len(RUNG_STEPS) and result.samples_used == (mc_delta.CHUNK,) * len(RUNG_STEPS)


def test_too_few_samples_is_an_error():
    with pytest.raises(InputError, match="cannot verify delta 0.02"):
        evr.calibrate_minsep(POISSON, 1.0, 0.02, samples=100)


def test_cli(capsys):
    common = [
        "--mechanism",
        "bandmf-minsep",
        "--delta",
        "0.02",
        "--steps",
        "60",
        "--sampling-prob",
        "0.05",
        "--min-sep",
        "4",
        "--bands",
        "3",
        "--max-contributions",
        "2",
        "--seed",
        "4",
    ]
    assert main(["-q", "calibrate", "--epsilon", "2", *common]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["verified"] and result["noise_multiplier"] < result["fallback_noise_multiplier"]
    assert result["delta"] <= 0.02 and result["samples"] == evr.default_samples(0.02)
    none = 0.95 ** (2 * 60)  # pi_0: no record in any of the 60 steps, 2 records a step at p = 0.05
    reduction = result["variance_reduction"]
    assert reduction["P"]["given_at_least_one_participation"]
    assert reduction["P"]["weight"] == pytest.approx((1 - none) / (1 - none * math.exp(-2)))
    assert reduction["Q"]["span"] == pytest.approx(1 - none * math.exp(2))
    assert not reduction["Q"]["certified_without_samples"]
    assert (
        main(
            [
                "-q",
                "epsilon",
                "--mechanism",
                "bandmf-minsep",
                "--noise-multiplier",
                "2",
                "--delta",
                "0.02",
                "--steps",
                "60",
            ]
        )
        == 2
    )
    assert "bandmf-minsep needs --sampling-prob" in capsys.readouterr().err
    assert main(["-q", "epsilon", "--noise-multiplier", str(result["noise_multiplier"]), *common]) == 0
    claimed = json.loads(capsys.readouterr().out)
    assert claimed["verified"] and claimed["epsilon"] < claimed["fallback_epsilon"]
    assert claimed["epsilon"] <= 2.0 * (1 + 0.32), "the inverse finds about the epsilon the calibration targeted"


def test_epsilon_inverse_is_private_by_the_exact_poisson_accountant():
    sigma = 1.4
    result = evr.epsilon_minsep(POISSON, sigma, 0.02, seed=2, fallback=EVERY_STEP)
    assert result.verified and result.overall_delta <= 0.02
    exact = epsilon(DpSgdUls(0.1, 30), sigma, 0.02)
    assert exact <= result.value < 1.5 * exact


@pytest.mark.beam
def test_beam_runner_gives_the_local_estimate_and_stops_where_local_does():
    """Chunks are seeded by (seed, chunk) and read in seed order: a Beam run, 64 chunks per pipeline, sums the
    same terms and a sequential verification stops at the same chunk as one read chunk by chunk."""
    process = MinSepProcess(60, 3, 0.1, 2, (1.0, 0.4))
    with mc_delta.task_map(1) as local:
        expected = mc_delta.estimate_delta(process, 0.9, 1.5, 20_000, (4,), local)
        verified = mc_delta.verify(process, 4.0, 1.5, 400_000, (5,), local, 1e-4, 1e-3)
    assert verified[0] and 8192 < verified[1] < 400_000, "the test needs several chunks, and stops before the budget"
    from madp.beam.monte_carlo import BeamTaskMap

    with mc_delta.task_map(1, functools.partial(BeamTaskMap, ["--runner", "DirectRunner"])) as beam:
        assert beam.wave > 1
        assert mc_delta.estimate_delta(process, 0.9, 1.5, 20_000, (4,), beam) == expected
        assert mc_delta.verify(process, 4.0, 1.5, 400_000, (5,), beam, 1e-4, 1e-3) == verified


def test_runner_options_are_checked(capsys):
    base = ["-q", "calibrate", "--epsilon", "2", "--delta", "1e-3", "--steps", "20"]
    assert main([*base, "--mechanism", "dpsgd", "--sampling-prob", "0.1", "--runner", "DirectRunner"]) == 2
    assert "bandmf-minsep only" in capsys.readouterr().err
    assert (
        main(
            [
                *base,
                "--mechanism",
                "bandmf-minsep",
                "--sampling-prob",
                "0.1",
                "--min-sep",
                "2",
                "--bands",
                "2",
                "--direct_num_workers",
                "2",
            ]
        )
        == 2
    )
    assert "--runner local takes no runner options" in capsys.readouterr().err


@pytest.mark.slow
def test_estimate_is_found_far_below_the_fallback():
    """With q = 0.01 amplification cuts sigma ~20x: the bracket must reach below fallback / 8."""
    process = MinSepProcess(30, 1, 0.01, 1, (1.0,))
    result = evr.calibrate_minsep(process, 1.0, 0.02, seed=2, fallback=EVERY_STEP)
    exact = calibrate(DpSgdUls(0.01, 30), 1.0, 0.02).noise_multiplier
    assert result.verified and exact <= result.value < 1.5 * exact < fallback_sigma(1.0, 0.02) / 8


def test_fallback_is_calibrated_at_the_delta_the_release_uses():
    """Theorem A.1 needs the fallback (epsilon, delta*)-DP at delta* < target, not at the target."""
    mechanism_delta, failure = evr.release_deltas(0.02)
    assert mechanism_delta + failure * (1 - mechanism_delta) == pytest.approx(0.02)
    assert failure == pytest.approx(evr.FAILURE_SHARE * 0.02) and mechanism_delta < 0.02
    assert sum(evr.rung_level(failure, rung) for rung in range(len(RUNG_STEPS))) < failure
    result = evr.calibrate_minsep(POISSON, 1.0, 0.02, seed=3, fallback=EVERY_STEP)
    assert (result.mechanism_delta, result.failure_probability) == (mechanism_delta, failure)
    assert result.overall_delta == pytest.approx(0.02)
    assert result.fallback == calibrate(EVERY_STEP, 1.0, mechanism_delta).noise_multiplier
    assert result.fallback > calibrate(EVERY_STEP, 1.0, 0.02).noise_multiplier, "the target delta's sigma is too small"


def test_epsilon_at_fixed_sigma_is_stated_as_a_claim_with_its_failure_probability():
    result = evr.epsilon_minsep(POISSON, 1.4, 0.02, seed=2, fallback=EVERY_STEP)
    stated = result.report(sigma_fixed=True)
    assert result.verified and stated["delta"] == result.mechanism_delta
    assert "false with probability" in stated["guarantee"] and 0 < stated["failure_probability"] < 0.02
    assert result.fallback == epsilon(EVERY_STEP, 1.4, result.mechanism_delta)


def test_non_negative_strategy_is_required_for_amplification():
    with pytest.raises(InputError, match="non-negative") as refused:
        MinSepProcess(30, 2, 0.1, 1, (1.0, -0.2))
    assert str(refused.value).endswith(": use strategy sqrt, or account without amplification")  # a Python caller
    assert refused.value.named(flag_of).endswith(": use --strategy sqrt, or account without amplification")  # the CLI


def poisson_delta(sigma: float, target_epsilon: float, sampling_prob: float = 0.1) -> float:
    """delta(epsilon) of POISSON (b = 1: Poisson-sampled DP-SGD) by the PLD accountant, independent of the kernels."""
    from dp_accounting import dp_event
    from dp_accounting.pld import pld_privacy_accountant

    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    accountant.compose(
        dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(sampling_prob, dp_event.GaussianDpEvent(sigma)), 30)
    )
    return accountant.get_delta(target_epsilon)


@pytest.mark.slow
def test_verification_given_one_participation_is_valid_and_beats_any_plain_test():
    """At p = 0.01 the user takes no part at all with probability pi_0 = 0.74: at epsilon 3 delta(Q || P) is 0
    by construction and P's tests run on samples given >= 1 participation, weighted by 0.27. A sigma whose
    PLD delta is 1.5 delta* still rarely passes (level 0.1); a private one passes with fewer samples than
    any test on plain [0, 1] terms needs, even if they were all 0."""
    process, bound, at = MinSepProcess(30, 1, 0.01, 1, (1.0,)), 5e-5, 3.0
    assert mc_delta.drawn_directions(process, at, bound) == ("P",)
    not_private, private = 0.54, 0.6
    assert poisson_delta(not_private, at, 0.01) > 1.5 * bound and poisson_delta(private, at, 0.01) < bound / 4
    with mc_delta.task_map(1) as mapper:
        passed = [
            mc_delta.verify(process, not_private, at, 400_000, (seed,), mapper, bound, 0.1)[0] for seed in range(40)
        ]
        private_runs = [
            mc_delta.verify(process, private, at, 400_000, (seed,), mapper, bound, 1e-4) for seed in range(3)
        ]
    assert sum(passed) <= 4 + 3 * (40 * 0.1 * 0.9) ** 0.5, sum(passed)
    plain_minimum = samples_to_reject_on_zeros(bound, 1e-4)
    assert all(run[0] and run[1] < plain_minimum for run in private_runs), (private_runs, plain_minimum)


@pytest.mark.slow
def test_sequential_verification_rarely_passes_a_candidate_that_is_not_private():
    """The verifier on the real kernels, with its early stops: at a sigma whose PLD delta is 1.47 delta*, 60
    verifications at level 0.1 pass at most about 10% of the time; at one below delta* / 4 they all
    pass, each with fewer samples than the fixed-sample Chernoff test at delta* / 2 needs."""
    bound = 0.002
    not_private, private = 1.52, 1.9
    assert poisson_delta(not_private, 1.0) > 1.45 * bound and poisson_delta(private, 1.0) < bound / 4
    with mc_delta.task_map(1) as mapper:
        passed = [
            mc_delta.verify(POISSON, not_private, 1.0, 100_000, (seed,), mapper, bound, 0.1)[0] for seed in range(60)
        ]
        private_runs = [
            mc_delta.verify(POISSON, private, 1.0, 100_000, (seed,), mapper, bound, 1e-4) for seed in range(5)
        ]
    assert sum(passed) <= 6 + 3 * (60 * 0.1 * 0.9) ** 0.5, sum(passed)
    half = bound / 2
    chernoff = math.log(1 / 1e-4) / (half * math.log(half / bound) + (1 - half) * math.log((1 - half) / (1 - bound)))
    assert all(run[0] and run[1] < chernoff for run in private_runs), (private_runs, chernoff)


def test_estimate_steps_down_from_a_coarser_target_to_the_right_value():
    """A known delta(sigma) = exp(-a sigma^2), as estimate_passes would see it without sampling error: the
    coarse-to-fine estimate lands on the sigma of the target, each level on 1/16 of the samples."""
    calls = []

    def estimate_passes(value, target, samples, early=True):
        calls.append(samples)
        delta = math.exp(-12.0 * value**2)
        return delta <= target, None if early and abs(math.log(delta / target)) > 1 else delta

    target = 1e-7
    value, slope = evr._estimate(estimate_passes, 12.0, 1.5, target, 16**3 * 4 * mc_delta.CHUNK)
    assert value == pytest.approx(math.sqrt(math.log(1 / target) / 12.0), rel=5e-3)  # half a rung
    assert slope == pytest.approx(-1 / (2 * math.log(1 / target)), rel=0.2)
    assert sorted(set(calls)) == [4 * mc_delta.CHUNK * 16**level for level in range(4)]
    assert calls.count(16**3 * 4 * mc_delta.CHUNK) <= 2, "the full sample count is drawn once or twice"


@pytest.mark.slow
def test_estimate_is_near_the_exact_poisson_sigma_at_a_small_delta():
    """The estimate on the real kernels, coarsening twice, against the PLD sigma where delta is the target."""
    process = MinSepProcess(30, 1, 0.1, 1, (1.0,))
    target = 4e-6
    with mc_delta.task_map(1) as mapper:

        def estimate_passes(value, goal, samples, early=True):
            return mc_delta.estimate_passes(process, value, 1.0, samples, (9, 0), mapper, goal, early)

        value, _ = evr._estimate(estimate_passes, 20.0, 2.5, target, 2_000_000)
    exact = calibrate(DpSgdUls(0.1, 30), 1.0, target).noise_multiplier
    assert value == pytest.approx(exact, rel=0.03)


def test_an_estimate_at_another_epsilon_and_the_same_sigma_draws_nothing_again():
    """The log ratios do not depend on epsilon: chunks drawn for one estimate keep their most extreme ratios,
    and an estimate at a larger epsilon (same sigma, same seeds) is computed from them, equal to drawing
    again; a smaller epsilon that the tails do not cover draws again."""
    process, sigma = MinSepProcess(60, 3, 0.05, 2, (0.9, 0.5)), 1.5
    drawn = []

    def counting_map(fn, tasks):
        tasks = list(tasks)
        drawn.extend(tasks)
        return map(fn, tasks)

    cached = mc_delta.ChunkMap(counting_map, 4)
    first = mc_delta.estimate_passes(process, sigma, 1.0, 40_000, (7,), cached, 1.0, early=False)
    assert len(drawn) == 5 and all(task.tail == mc_delta.TAIL for task in drawn)
    again = mc_delta.estimate_passes(process, sigma, 2.5, 40_000, (7,), cached, 1.0, early=False)
    assert len(drawn) == 5, "nothing drawn again"
    fresh = mc_delta.estimate_passes(process, sigma, 2.5, 40_000, (7,), mc_delta.ChunkMap(map, 4), 1.0, early=False)
    assert again == pytest.approx(fresh, rel=1e-12) and again[1] < first[1]
    mc_delta.estimate_passes(process, sigma, 0.05, 40_000, (7,), cached, 1.0, early=False)
    assert len(drawn) == 10, "a small epsilon needs more than the tails"


def test_chunk_tails_serve_only_their_own_process():
    """One map's tails are keyed by the process too: an estimate of another process draws its own chunks."""
    shared = mc_delta.ChunkMap(map, 4)
    first, second = MinSepProcess(60, 3, 0.05, 2, (0.9, 0.5)), MinSepProcess(60, 3, 0.2, 2, (0.9, 0.5))
    mc_delta.estimate_passes(first, 1.5, 1.0, 20_000, (7,), shared, 1.0, early=False)
    alone = mc_delta.estimate_passes(second, 1.5, 2.5, 20_000, (7,), mc_delta.ChunkMap(map, 4), 1.0, early=False)
    assert mc_delta.estimate_passes(second, 1.5, 2.5, 20_000, (7,), shared, 1.0, early=False) == alone
