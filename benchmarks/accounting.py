"""Accounting benchmark: time to calibrate DP-SGD's noise multiplier to three significant digits.

Issue 4 target: `dpsgd` with T = 10,000 steps and k = 4 records per user in under 30 s.
(The Monte Carlo figures of that issue come with the b-min-sep accountant, not built yet.)

    python benchmarks/accounting.py
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from accounting.calibrate import calibrate  # noqa: E402
from accounting.mechanisms import DpSgd, DpSgdUls  # noqa: E402

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


if __name__ == "__main__":
    main()
