"""Estimate-verify-release calibration of BandMF with b-min-sep sampling (Algorithm 5)."""
from __future__ import annotations

import dataclasses
import json

import pytest

import accounting.evr as evr
from accounting.calibrate import calibrate, epsilon
from accounting.mechanisms import DpSgdUls
from accounting.monte_carlo import MinSepProcess
from madp.cli import main
from madp.records import InputError

POISSON = MinSepProcess(30, 1, 0.1, 1, (1.0,))  # b = 1, one band, k_u = 1: DP-SGD with Poisson sampling


EVERY_STEP = DpSgdUls(1.0, 30)  # POISSON's participations without amplification


def fallback_sigma(target_epsilon: float, delta: float) -> float:
    return calibrate(EVERY_STEP, target_epsilon, delta).noise_multiplier


def test_released_sigma_is_private_by_the_exact_poisson_accountant():
    result = evr.calibrate_minsep(POISSON, 1.0, 0.02, seed=3, fallback=EVERY_STEP)
    assert result.verified and result.overall_delta <= 0.02
    exact = calibrate(DpSgdUls(0.1, 30), 1.0, 0.02).noise_multiplier  # the same PLD as dpsgd with k = 1
    assert exact <= result.value < 1.5 * exact
    assert epsilon(DpSgdUls(0.1, 30), result.value, 0.02) <= 1.0


def test_same_result_for_any_number_of_workers():
    runs = [evr.calibrate_minsep(MinSepProcess(40, 3, 0.08, 2, (0.8, 0.6)), 2.0, 0.02, seed=1, workers=w)
            for w in (1, 2)]
    assert [run.attempts for run in runs] == [1, 2], "the ledger counts every run of the same calibration"
    assert runs[0] == dataclasses.replace(runs[1], attempts=1)


def test_fallback_is_released_when_no_candidate_verifies(monkeypatch):
    real = evr.estimate_delta

    def optimistic_estimate(process, sigma, eps, samples, seed, workers):
        return 0.0 if seed[1] == 0 else real(process, sigma, eps, samples, seed, workers)  # a wrong estimate

    monkeypatch.setattr(evr, "estimate_delta", optimistic_estimate)
    # A fallback of three unamplified steps (sigma ~4.4, a test double) puts the bisection's floor at
    # fallback / 8 ~ 0.55, and every candidate up to 0.55 * 1.32 is far below the ~1.2 that Poisson DP-SGD
    # needs here: all must fail verification.
    result = evr.calibrate_minsep(POISSON, 1.0, 0.02, seed=3, fallback=DpSgdUls(1.0, 3))
    assert result.fallback < 5 and result.ladder[-1] < 1.0
    assert not result.verified and result.value == result.fallback and result.outcomes == (False,)


def test_too_few_samples_is_an_error():
    with pytest.raises(InputError, match="give at best delta"):
        evr.calibrate_minsep(POISSON, 1.0, 0.02, samples=100)


def test_cli(capsys):
    common = ["--mechanism", "bandmf-minsep", "--delta", "0.02", "--steps", "60", "--sampling-prob", "0.05",
              "--min-sep", "4", "--bands", "3", "--max-contributions", "2", "--seed", "4"]
    assert main(["-q", "calibrate", "--epsilon", "2", *common]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["verified"] and result["noise_multiplier"] < result["fallback_noise_multiplier"]
    assert result["delta"] <= 0.02 and result["samples"] == evr.samples_needed(0.02, 0.01)
    assert main(["-q", "epsilon", "--mechanism", "bandmf-minsep", "--noise-multiplier", "2", "--delta", "0.02",
                 "--steps", "60"]) == 2
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


def test_beam_runner_gives_the_local_estimate():
    """Chunks are seeded by (seed, direction, chunk): a Beam run (2 worker processes) sums the same terms."""
    process = MinSepProcess(60, 3, 0.1, 2, (1.0, 0.4))
    with evr.task_map(1) as local:
        expected = evr.estimate_delta(process, 0.9, 1.5, 20_000, (4,), local)
    with evr.task_map(1, ["--runner", "DirectRunner"]) as beam:
        assert evr.estimate_delta(process, 0.9, 1.5, 20_000, (4,), beam) == expected


def test_runner_options_are_checked(capsys):
    base = ["-q", "calibrate", "--epsilon", "2", "--delta", "1e-3", "--steps", "20"]
    assert main([*base, "--mechanism", "dpsgd", "--sampling-prob", "0.1", "--runner", "DirectRunner"]) == 2
    assert "bandmf-minsep only" in capsys.readouterr().err
    assert main([*base, "--mechanism", "bandmf-minsep", "--sampling-prob", "0.1", "--min-sep", "2", "--bands", "2",
                 "--direct_num_workers", "2"]) == 2
    assert "--runner local takes no Beam options" in capsys.readouterr().err


def test_estimate_is_found_far_below_the_fallback():
    """With q = 0.01 amplification cuts sigma ~20x: the bracket must reach below fallback / 8."""
    process = MinSepProcess(30, 1, 0.01, 1, (1.0,))
    result = evr.calibrate_minsep(process, 1.0, 0.02, seed=2, fallback=EVERY_STEP)
    exact = calibrate(DpSgdUls(0.01, 30), 1.0, 0.02).noise_multiplier
    assert result.verified and exact <= result.value < 1.5 * exact < fallback_sigma(1.0, 0.02) / 8


def test_fallback_is_calibrated_at_the_delta_the_release_uses():
    """Theorem A.1 needs the fallback (epsilon, delta*)-DP at the minimizing delta* < target, not at the target."""
    process = MinSepProcess(30, 1, 0.1, 1, (1.0,))
    samples = evr.samples_needed(0.02, 0.01)
    mechanism_delta, overall = evr.release_deltas(0.01, samples, 0.02)
    assert 0.01 < mechanism_delta < 0.02 and overall <= 0.02
    result = evr.calibrate_minsep(process, 1.0, 0.02, seed=3, fallback=EVERY_STEP)
    assert result.mechanism_delta == mechanism_delta
    assert result.fallback == calibrate(EVERY_STEP, 1.0, mechanism_delta).noise_multiplier
    assert result.fallback > calibrate(EVERY_STEP, 1.0, 0.02).noise_multiplier, "the target delta's sigma is too small"
    assert overall == pytest.approx(mechanism_delta + result.failure_probability * (1 - mechanism_delta))


def test_epsilon_at_fixed_sigma_is_stated_as_a_claim_with_its_failure_probability():
    result = evr.epsilon_minsep(POISSON, 1.4, 0.02, seed=2, fallback=EVERY_STEP)
    stated = result.report(sigma_fixed=True)
    assert result.verified and stated["delta"] == result.mechanism_delta
    assert "false with probability" in stated["guarantee"] and 0 < stated["failure_probability"] < 0.02
    assert result.fallback == epsilon(EVERY_STEP, 1.4, result.mechanism_delta)


def test_non_negative_strategy_is_required_for_amplification():
    with pytest.raises(InputError, match="non-negative"):
        MinSepProcess(30, 2, 0.1, 1, (1.0, -0.2))
