"""Times jax_privacy's Monte Carlo privacy-loss sampler for b-min-sep BandMF; run by benchmarks/accounting.py
in its own environment (jax_privacy 2.0.0 and its pinned dependencies), so it imports nothing of madp.

    python jax_privacy_monte_carlo.py STEPS MIN_SEP SAMPLING_PROB SAMPLES COEFFICIENTS_JSON SIGMA EPSILON [NPZ]

prints one JSON object: microseconds per sample in each direction (best of 3 runs, one thread) and each
direction's hockey-stick estimate of delta(EPSILON) with its standard error (from all 3 runs). With NPZ,
it also saves the first 2048 outputs drawn under P and jax_privacy's privacy losses at them.
"""

from __future__ import annotations

import json
import os
import sys
import time

for variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[variable] = "1"

import jax_privacy  # noqa: E402
import numpy as np  # noqa: E402
from jax_privacy import batch_selection  # noqa: E402
from jax_privacy.experimental.monte_carlo import sample_generation  # noqa: E402


def main() -> None:
    steps, min_sep, sampling_prob, samples = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
    coefficients = np.asarray(json.loads(sys.argv[5]), dtype=np.float64)
    sigma, epsilon = float(sys.argv[6]), float(sys.argv[7])
    strategy = batch_selection.BMinSepSampling(sampling_prob, steps, min_sep, warm_start=False)
    timings, deltas = {}, {}
    for direction, positive in (("P", True), ("Q", False)):
        runs, terms = [], []
        for seed in range(3):
            started = time.perf_counter()
            losses, _ = sample_generation.get_privacy_loss_sample(
                strategy, sigma, coefficients, seed=seed, positive_sample=positive, num_samples=samples
            )
            runs.append((time.perf_counter() - started) / samples * 1e6)
            if len(sys.argv) > 8 and positive and seed == 0:
                kept_losses, kept_outputs = sample_generation.get_privacy_loss_sample(
                    strategy, sigma, coefficients, seed=seed, positive_sample=True, num_samples=2048
                )
                np.savez(sys.argv[8], outputs=kept_outputs, losses=kept_losses)
            # losses are log P/Q under P and log Q/P under Q: delta = E[(1 - e^(eps - loss))_+]
            terms.append(np.clip(-np.expm1(epsilon - np.asarray(losses)), 0.0, None))
        timings[direction] = min(runs)
        terms = np.concatenate(terms)
        deltas[direction] = (float(terms.mean()), float(terms.std(ddof=1) / np.sqrt(len(terms))))
    print(json.dumps({"version": jax_privacy.__version__, "us_per_sample": timings, "delta": deltas}))


if __name__ == "__main__":
    main()
