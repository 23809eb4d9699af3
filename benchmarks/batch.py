"""Batch materialization benchmark: b-min-sep sampling on the local engine vs the Beam DirectRunner.

Setup (not timed): a skewed synthetic graph (App. C.1), bounded with K = 3 by the local engine.
Measured, best of --repeats runs (timings on shared 2-core machines vary by +-20%):
- local sampling: calibrate p, sample, exclude (madp.engines.batch_local.minsep_rows) on the loaded data,
  i.e. without reading the input or writing TFRecords; rate in sampled (record, step) pairs/s;
- reading: read, validate and join the selection (madp.engines.batch_local.load);
- TFRecord writing: end to end minus reading and sampling (order, truncate, encode, frame, write);
- local end to end: `madp batch --runner local` (read, join, sample, write);
- DirectRunner end to end: `madp batch` on Beam's DirectRunner (2 worker processes);
and the sampling time at three sizes, to show it is linear in the number of samples.
Targets (issue 3): local sampling >= 1M pairs/s; DirectRunner within 5x of local.

    python benchmarks/batch.py [--records 1000000] [--steps 1000] [--batch-size 1000] [--min-sep 8] [--partitions P]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def best_of(repeats: int, run) -> tuple[float, float, object]:
    times, result = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - started)
    return min(times), max(times), result


def prepare(directory: str, records: int) -> tuple[str, str]:
    from madp.core.selection import BoundOptions
    from madp.engines.local_engine import run_local as bound
    from madp.tools.data.synthetic import GraphSpec, generate, write_dataset

    spec = GraphSpec(records=records, graph="skewed", seed=1)
    data = os.path.join(directory, f"records-{records}")
    write_dataset(generate(spec), spec, data, shards=4)
    selected = os.path.join(directory, f"bounded-{records}")
    bound(data, selected, BoundOptions(max_contributions=3))
    return selected, data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=float, default=1000)
    parser.add_argument("--min-sep", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--partitions", type=int, help="madp's --partitions on the DirectRunner (default: madp's)")
    args = parser.parse_args()

    import logging

    from madp.beam.batch import run_beam
    from madp.engines import batch_local, batching

    logging.disable(logging.INFO)
    options = batching.BatchOptions(steps=args.steps, batch_size=args.batch_size, min_sep=args.min_sep)
    results: dict = {
        "records": args.records,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "min_sep": args.min_sep,
        "partitions": args.partitions,
    }
    beam_args = ["--runner", "DirectRunner"] + ([f"--partitions={args.partitions}"] if args.partitions else [])
    with tempfile.TemporaryDirectory() as directory:
        selected, data = prepare(directory, args.records)
        fastest, _, dataset = best_of(
            args.repeats, lambda: batch_local.load(selected, data, options, os.path.join(directory, "out"))
        )
        results["selected_records"] = len(dataset.copies)
        results["local_reading_s"] = round(fastest, 3)
        fastest, slowest, sampled = best_of(args.repeats, lambda: batch_local.minsep_rows(dataset, options))
        rows = len(sampled.record)
        results["local_sampling"] = {
            "s": round(fastest, 3),
            "slowest_s": round(slowest, 3),
            "rows": rows,
            "pairs_per_s": round(rows / fastest),
        }

        def local_end_to_end():
            return batch_local.run_local(selected, data, os.path.join(directory, "local"), options)

        fastest, slowest, report = best_of(args.repeats, local_end_to_end)
        results["local_end_to_end"] = {
            "s": round(fastest, 3),
            "slowest_s": round(slowest, 3),
            "pairs_per_s": round(rows / fastest),
        }
        files = [f for f in os.listdir(os.path.join(directory, "local")) if f.endswith(".tfrecord")]
        results["tfrecord_bytes"] = sum(os.path.getsize(os.path.join(directory, "local", f)) for f in files)
        # Derived: end to end minus reading and sampling, each the fastest of its own runs.
        results["local_writing_s"] = round(
            results["local_end_to_end"]["s"] - results["local_reading_s"] - results["local_sampling"]["s"], 3
        )

        fastest, slowest, _ = best_of(
            args.repeats,
            lambda: run_beam(selected, data, os.path.join(directory, "beam"), options, beam_args),
        )
        results["direct_runner_end_to_end"] = {
            "s": round(fastest, 3),
            "slowest_s": round(slowest, 3),
            "pairs_per_s": round(rows / fastest),
        }
        results["direct_over_local"] = round(fastest / results["local_end_to_end"]["s"], 2)

        scaling = []
        for fraction in (0.25, 0.5, 1.0):
            steps = max(1, int(args.steps * fraction))
            scaled = batching.BatchOptions(steps=steps, batch_size=args.batch_size, min_sep=args.min_sep)
            fastest, _, sampled = best_of(args.repeats, lambda scaled=scaled: batch_local.minsep_rows(dataset, scaled))
            scaling.append(
                {
                    "steps": steps,
                    "rows": len(sampled.record),
                    "s": round(fastest, 3),
                    "us_per_row": round(1e6 * fastest / max(1, len(sampled.record)), 3),
                }
            )
        results["sampling_scaling"] = scaling
        # Cost per extra row between the smallest and largest size: the rest is per-record set-up
        # (unit keys, neighbourhood sizes, calibration of p), independent of the number of steps.
        extra_rows = scaling[-1]["rows"] - scaling[0]["rows"]
        results["sampling_marginal_us_per_row"] = round(
            1e6 * (scaling[-1]["s"] - scaling[0]["s"]) / max(1, extra_rows), 3
        )
        results["mean_batch_size"] = report.batch_sizes.mean
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
