"""Accounting benchmark: time to calibrate DP-SGD's noise multiplier to three significant digits, and
Monte Carlo accounting for b-min-sep BandMF.

Issue 4 targets: `dpsgd` with T = 10,000 steps and k = 4 records per user in under 30 s. Issue 13
targets, for T = 1000, b = 8, 8 bands, p = 0.01, epsilon 4 on 2 cores: calibration at delta 1e-5 in
<= 3 min and at delta 1e-6 in <= 15 min; per sample >= 10x faster than jax_privacy 2.0.0's Monte
Carlo on one core. jax_privacy runs in its own environment (benchmarks/.jax-privacy-env, created on
first use with pip; --skip-reference to go without), timed by benchmarks/jax_privacy_monte_carlo.py.

    python benchmarks/accounting.py [--skip-reference] [--skip-calibrations]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from madp.accounting.calibrate import calibrate  # noqa: E402
from madp.accounting.evr import calibrate_minsep  # noqa: E402
from madp.accounting.mc_delta import estimate_delta, task_map  # noqa: E402
from madp.accounting.mechanisms import DpSgd, DpSgdUls  # noqa: E402
from madp.accounting.monte_carlo import MinSepProcess, hockey_stick, log_likelihood_ratio, sample_log_ratios  # noqa: E402
from madp.accounting.strategies import sqrt_coefficients  # noqa: E402

SAMPLES = 8192
PAIRS = 64 * 8192  # of the worker scaling run
REFERENCE_ENV = os.path.join(ROOT, "benchmarks", ".jax-privacy-env")
REFERENCE = "jax_privacy==2.0.0"

CASES = [
    ("dpsgd T=10000 q=0.01 k=4 eps=8", DpSgd(0.01, 10_000, 4), 8.0),
    ("dpsgd T=10000 q=0.01 k=4 eps=2", DpSgd(0.01, 10_000, 4), 2.0),
    ("dpsgd T=10000 q=0.01 k=1 eps=2", DpSgd(0.01, 10_000, 1), 2.0),
    ("dpsgd-uls T=10000 q=0.01 eps=2", DpSgdUls(0.01, 10_000), 2.0),
]


def dpsgd_calibrations() -> None:
    print(f"{'case (delta 1e-5, sigma to 1e-3 relative)':<40}{'sigma':>10}{'epsilon':>10}{'evals':>7}{'wall s':>9}")
    for name, mechanism, target in CASES:
        started = time.perf_counter()
        result = calibrate(mechanism, target, 1e-5)
        wall = time.perf_counter() - started
        print(f"{name:<40}{result.noise_multiplier:>10.4f}{result.epsilon:>10.4f}{result.evaluations:>7}{wall:>9.1f}")


def reference_python() -> str:
    """The reference environment's python, created with pip on first use."""
    python = os.path.join(REFERENCE_ENV, "bin", "python")
    if not os.path.exists(python):
        print(f"creating {REFERENCE_ENV} with {REFERENCE} (once)...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", REFERENCE_ENV], check=True)
        subprocess.run([python, "-m", "pip", "install", "-q", REFERENCE], check=True)
    return python


def reference_run(
    steps: int, min_sep: int, samples: int, sigma: float, epsilon: float, *keep: str, sampling_prob: float = 0.01
) -> dict:
    """jax_privacy's timings and estimates (benchmarks/jax_privacy_monte_carlo.py) with b = min-sep sqrt bands."""
    coefficients = json.dumps(list(sqrt_coefficients(min_sep)))
    out = subprocess.run(
        [
            reference_python(),
            os.path.join(ROOT, "benchmarks", "jax_privacy_monte_carlo.py"),
            str(steps),
            str(min_sep),
            str(sampling_prob),
            str(samples),
            coefficients,
            str(sigma),
            str(epsilon),
            *keep,
        ],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def published_recursion(
    outputs: np.ndarray, coefficients: np.ndarray, sampling_prob: float, sigma: float, tail_norms_reversed: bool
) -> np.ndarray:
    """jax_privacy 2.0.0's b-min-sep privacy loss (the paper's recursion in log space, b = len(coefficients)),
    restated here to locate where it departs from ours: it gives the last b - 1 steps their partial norms
    ||c_i||^2 in reverse order (`tail_norms_reversed`)."""
    steps, bands = outputs.shape[0], len(coefficients)
    padded = np.vstack([outputs, np.zeros((bands, outputs.shape[1]))])
    dots = sum(c * padded[lag : lag + steps] for lag, c in enumerate(coefficients))
    partial = np.cumsum(coefficients**2)[:-1]
    norms = np.full(steps, float(np.sum(coefficients**2)))
    norms[steps - bands + 1 :] = partial if tail_norms_reversed else partial[::-1]
    log_f = np.zeros((steps + bands, outputs.shape[1]))
    for i in range(steps - 1, -1, -1):
        log_f[i] = np.logaddexp(
            np.log1p(-sampling_prob) + log_f[i + 1],
            np.log(sampling_prob) + (2 * dots[i] - norms[i]) / (2 * sigma**2) + log_f[i + bands],
        )
    return log_f[0]


def kernel_timings(with_reference: bool) -> None:
    print(
        f"\nMonte Carlo, b-min-sep BandMF (bands = b, p = 0.01, k_u = 1, sigma = 1), one core, best of 10 runs (ours) "
        f"or 3 (jax_privacy) of {SAMPLES} samples; 'per sample' is one sample of one direction:"
    )
    for steps, min_sep in ((1000, 8), (2000, 16)):
        process = MinSepProcess(steps, min_sep, 0.01, 1, tuple(sqrt_coefficients(min_sep)))
        runs = []
        for seed in range(10):
            started = time.perf_counter()
            sample_log_ratios(process, 1.0, SAMPLES, seed)  # both directions, sharing the noise
            runs.append((time.perf_counter() - started) / SAMPLES * 1e6)
        ours = min(runs) / 2
        # The textbook form in this process: numpy, the recursion step by step in log space, vectorized
        # over 2048 samples of one direction
        outputs = np.random.default_rng(0).standard_normal((steps, 2048))
        started = time.perf_counter()
        published_recursion(outputs, np.asarray(process.coefficients), 0.01, 1.0, tail_norms_reversed=False)
        textbook = (time.perf_counter() - started) / 2048 * 1e6
        line = (
            f"  T = {steps}, b = {min_sep}: ours {ours:.1f} us per sample ({2 * ours:.1f} per P + Q pair); "
            f"numpy step-by-step log-space recursion {textbook:.1f} us"
        )
        if with_reference and steps == 1000:
            reference = reference_run(steps, min_sep, SAMPLES, 1.0, 4.0)["us_per_sample"]
            mean = (reference["P"] + reference["Q"]) / 2
            line += (
                f"; jax_privacy 2.0.0 {reference['P']:.1f} (P) / {reference['Q']:.1f} (Q) us: "
                f"{mean / ours:.1f}x (target >= 10x)"
            )
        print(line, flush=True)


def estimates_agree(with_reference: bool) -> None:
    """Our delta estimate and jax_privacy's at the same point, each with its standard error."""
    if not with_reference:
        return
    steps, min_sep, sigma, epsilon, samples = 1000, 8, 0.5, 3.0, 262_144
    process = MinSepProcess(steps, min_sep, 0.01, 1, tuple(sqrt_coefficients(min_sep)))
    ratios = np.concatenate([sample_log_ratios(process, sigma, samples, seed) for seed in range(3)], axis=1)
    ours = [hockey_stick(row, epsilon, under) for row, under in zip(ratios, ("P", "Q"))]
    with tempfile.TemporaryDirectory() as directory:
        kept = os.path.join(directory, "outputs.npz")
        theirs = reference_run(steps, min_sep, samples, sigma, epsilon, kept)["delta"]
        with np.load(kept) as saved:
            outputs, their_losses = saved["outputs"], saved["losses"]
    print(f"\n  delta({epsilon}) at T = {steps}, b = {min_sep}, sigma = {sigma}, 3 x {samples} samples per direction:")
    for (mean, error), under in zip(ours, ("P", "Q")):
        their_mean, their_error = theirs[under]
        gap = abs(mean - their_mean) / max(np.hypot(error, their_error), 1e-300)
        print(
            f"    {under}: ours {mean:.5f} +- {error:.5f}, jax_privacy {their_mean:.5f} +- {their_error:.5f} "
            f"({gap:.1f} standard errors apart)"
        )
    mine = log_likelihood_ratio(process, sigma, outputs)
    coefficients = np.asarray(process.coefficients)
    print(
        f"  log P/Q at jax_privacy's first 2048 outputs under P: ours minus theirs up to "
        f"{np.abs(mine - their_losses).max():.3g}; their recursion restated here gives theirs to "
        f"{np.abs(published_recursion(outputs, coefficients, 0.01, sigma, True) - their_losses).max():.1g}, and with "
        f"the last b - 1 steps' partial norms in order gives ours to "
        f"{np.abs(published_recursion(outputs, coefficients, 0.01, sigma, False) - mine).max():.1g}"
    )


def worker_scaling() -> None:
    process = MinSepProcess(1000, 8, 0.01, 1, tuple(sqrt_coefficients(8)))
    timings = {}
    for workers in (1, os.cpu_count() or 1):
        started = time.perf_counter()
        with task_map(workers) as mapper:
            estimate_delta(process, 1.0, 2.0, PAIRS, (0,), mapper)
        timings[workers] = time.perf_counter() - started
    for workers, wall in timings.items():
        print(
            f"  worker processes {workers}: {wall:.1f} s for {PAIRS:,} P + Q pairs, pool start included: "
            f"{wall * workers / (2 * PAIRS) * 1e6:.1f} us per sample per core; speed-up {timings[1] / wall:.2f}x"
        )


def minsep_calibrations() -> None:
    print(
        "\nmadp calibrate --mechanism bandmf-minsep --epsilon 4 --steps 1000 --sampling-prob 0.01 --min-sep 8 "
        "--bands 8 --workers 2:"
    )
    process = MinSepProcess(1000, 8, 0.01, 1, tuple(sqrt_coefficients(8)))
    with tempfile.TemporaryDirectory() as ledger:
        os.environ["MADP_ATTEMPTS_LEDGER"] = os.path.join(ledger, "attempts.jsonl")  # not the user's ledger
        for delta, target in ((1e-5, 180), (1e-6, 900)):
            started = time.perf_counter()
            result = calibrate_minsep(process, 4.0, delta, workers=2)
            wall = time.perf_counter() - started
            print(
                f"  delta {delta:g}: sigma {result.value:.4f} ({'verified' if result.verified else 'FALLBACK'}; "
                f"estimate {result.estimate:.4f}, fallback {result.fallback:.2f}), candidates tried "
                f"{len(result.outcomes)}, samples drawn {sum(result.samples_used):,} of a budget of "
                f"{result.samples:,} per candidate; {wall:.0f} s (target <= {target} s)",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description="Accounting benchmark: DP-SGD calibration and b-min-sep Monte Carlo")
    parser.add_argument("--skip-reference", action="store_true", help="do not run jax_privacy")
    parser.add_argument("--skip-calibrations", action="store_true", help="skip the two bandmf-minsep calibrations")
    args = parser.parse_args()
    dpsgd_calibrations()
    kernel_timings(not args.skip_reference)
    estimates_agree(not args.skip_reference)
    worker_scaling()
    if not args.skip_calibrations:
        minsep_calibrations()


if __name__ == "__main__":
    main()
