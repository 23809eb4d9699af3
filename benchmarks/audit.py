"""Audit benchmark: `madp audit` with m = 1000 canaries on an auditable job, three ways.

The same config (default examples/audit.yaml) is audited with a non-private audit model (what the
audit sees when nothing protects), with the config's DP-SGD, and with the noise scaled down 100x
while the claim is kept (a broken mechanism the audit must refute). Each line prints the measured
lower bound on epsilon, the claim, the correct guesses, the most the audit could measure, whether
it failed, and the wall time (generation, bounding, batching, calibration, training and scoring).

    python benchmarks/audit.py [--config examples/audit.yaml] [--canaries 1000]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=os.path.join(ROOT, "examples", "audit.yaml"))
    parser.add_argument("--canaries", type=int, default=1000)
    args = parser.parse_args()

    from madp import cli

    runs = (
        ("non-private audit model", ["--non-private"]),
        ("DP-SGD (the config)", []),
        ("DP-SGD, noise x 0.01, same claim", ["--testing-only-noise-scale", "0.01"]),
    )
    print(
        f"{'audit model':34} {'lower bound':>11} {'claimed':>8} {'correct':>11} {'measurable':>10} "
        f"{'exit':>4} {'wall s':>7}"
    )
    with tempfile.TemporaryDirectory() as directory:
        for name, flags in runs:
            started = time.perf_counter()
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                code = cli.main(
                    [
                        "-q",
                        "audit",
                        args.config,
                        "--set",
                        f"run_dir={directory}",
                        "--canaries",
                        str(args.canaries),
                        *flags,
                    ]
                )
            wall = time.perf_counter() - started
            result = json.loads(printed.getvalue())
            claimed = result["claimed_epsilon"]
            print(
                f"{name:34} {result['epsilon_lower_bound']:>11.3f} "
                f"{'none' if claimed is None else f'{claimed:.3f}':>8} "
                f"{result['correct_guesses']:>5} / {result['guesses']:<4} "
                f"{result['largest_measurable_epsilon']:>10.3f} "
                f"{code:>4} {wall:>7.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
