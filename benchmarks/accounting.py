"""Accounting benchmark: time to calibrate DP-SGD's noise multiplier to three significant digits.

Issue 4 targets: `dpsgd` with T = 10,000 steps and k = 4 records per user in under 30 s; Monte
Carlo accounting for b-min-sep BandMF at <= 20 us per sample per core for T = 1000, b = 8 (the
public numpy reference, jax_privacy 2.0.0 experimental/monte_carlo, needs ~113 us).

    python benchmarks/accounting.py
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from accounting.calibrate import calibrate  # noqa: E402
from accounting.mechanisms import DpSgd, DpSgdUls  # noqa: E402
from accounting.evr import estimate_delta, task_map  # noqa: E402
from accounting.monte_carlo import MinSepProcess, _direct_log_weight, _recursion_log, sample_log_ratios  # noqa: E402
from accounting.strategies import sqrt_coefficients  # noqa: E402

MONTE_CARLO = [(1000, 8), (2000, 16)]
SAMPLES = 8192

CASES = [
    ("dpsgd T=10000 q=0.01 k=4 eps=8", DpSgd(0.01, 10_000, 4), 8.0),
    ("dpsgd T=10000 q=0.01 k=4 eps=2", DpSgd(0.01, 10_000, 4), 2.0),
    ("dpsgd T=10000 q=0.01 k=1 eps=2", DpSgd(0.01, 10_000, 1), 2.0),
    ("dpsgd-uls T=10000 q=0.01 eps=2", DpSgdUls(0.01, 10_000), 2.0),
]


def main() -> None:
    print(f"{'case (delta 1e-5, sigma to 1e-3 relative)':<40}{'sigma':>10}{'epsilon':>10}{'evals':>7}{'wall s':>9}")
    for name, mechanism, target in CASES:
        started = time.perf_counter()
        result = calibrate(mechanism, target, 1e-5)
        wall = time.perf_counter() - started
        print(f"{name:<40}{result.noise_multiplier:>10.4f}{result.epsilon:>10.4f}{result.evaluations:>7}{wall:>9.1f}")
    print(f"\nMonte Carlo, b-min-sep BandMF (bands = b, p = 0.01, k_u = 1, sigma = 1), one core, best of 3 x "
          f"{SAMPLES} samples:")
    for steps, min_sep in MONTE_CARLO:
        process = MinSepProcess(steps, min_sep, 0.01, 1, tuple(sqrt_coefficients(min_sep)))
        timings = {}
        for under in ("P", "Q"):
            runs = []
            for seed in range(3):  # best of 3
                started = time.perf_counter()
                sample_log_ratios(process, 1.0, SAMPLES, seed=seed, under=under)
                runs.append((time.perf_counter() - started) / SAMPLES * 1e6)
            timings[under] = min(runs)
        # Reference in this process: the textbook form, log weights from the definition and the
        # recursion step by step in log space, on outputs drawn the same way (2048 samples).
        outputs = np.random.default_rng(0).standard_normal((steps, 2048))

        def fill(out, first):
            out[:] = outputs[first:first + len(out)]
        started = time.perf_counter()
        _recursion_log(process, _direct_log_weight(process, 1.0, fill, 2048))
        reference = (time.perf_counter() - started) / 2048 * 1e6
        print(f"  T = {steps}, b = {min_sep}: {timings['P']:.1f} us per sample under P, {timings['Q']:.1f} under Q "
              f"(target <= 20 at T = 1000, b = 8); step-by-step log-space reference {reference:.1f} us "
              f"({reference / timings['P']:.1f}x)")
    process = MinSepProcess(1000, 8, 0.01, 1, tuple(sqrt_coefficients(8)))
    timings = {}
    for workers in (1, os.cpu_count() or 1):
        started = time.perf_counter()
        with task_map(workers) as mapper:
            estimate_delta(process, 1.0, 2.0, 8 * 8192, (0,), mapper)  # both directions: 2 x 65,536 samples
        timings[workers] = time.perf_counter() - started
    for workers, wall in timings.items():
        print(f"  worker processes {workers}: {wall:.1f} s for 131,072 samples (T = 1000, b = 8, both directions): "
              f"{wall * workers / 131072 * 1e6:.1f} us per sample per core; speed-up {timings[1] / wall:.2f}x")


if __name__ == "__main__":
    main()
