"""Scale benchmark of the Beam pipelines on the DirectRunner: bounding and batching skewed records of
growing size, each against `--runner local` in the same run.

For each size: generate the skewed graph (`madp generate --graph skewed`), bound it (K = 3) and batch
the selection (b-min-sep sampling), once with `--runner local` and once on the DirectRunner (one
worker, `--partitions` scaled with the size). Each run is a child process; a thread samples the
resident memory of the child and of every process below it every 0.2 s, so the peak of the driver
and of the largest worker are reported apart. The bounding's report gives, per iteration of the
pipeline run, the undecided incidences left and the bytes of arrays its steps sent through shuffles.

    python benchmarks/scale.py [--sizes 1000000,10000000] [--records-per-partition 250000] [--only bound]
        [--local-finish-incidences N] [--records-per-file R]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def child(job: str, runner: str, args: list[str]) -> dict:
    """`madp JOB ... --runner RUNNER` in a child process: wall time, peak memory of the driver and of
    the largest process below it."""
    command = [sys.executable, "-m", "madp.cli", "-q", job, *args, "--runner", runner]
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peaks: dict[int, int] = {}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            workers = _descendants(process.pid)
            for pid in [process.pid, *workers]:
                peaks[pid] = max(peaks.get(pid, 0), _rss_kb(pid))
            done.wait(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _, err = process.communicate()
    done.set()
    sampler.join()
    if process.returncode:
        raise SystemExit(f"madp {job} --runner {runner} failed:\n{err[-3000:]}")
    workers = [kb for pid, kb in peaks.items() if pid != process.pid]
    return {
        "wall_s": round(time.perf_counter() - started, 2),
        "driver_peak_mb": round(peaks.get(process.pid, 0) / 1024),
        "largest_worker_peak_mb": round(max(workers, default=0) / 1024),
        "median_worker_peak_mb": round(sorted(workers)[len(workers) // 2] / 1024) if workers else 0,
    }


def _descendants(pid: int) -> list[int]:
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        try:
            for task in os.listdir(f"/proc/{parent}/task"):
                with open(f"/proc/{parent}/task/{task}/children") as handle:
                    children = [int(c) for c in handle.read().split()]
                found.extend(children)
                frontier.extend(children)
        except OSError:
            continue
    return found


def _rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1000000,10000000")
    parser.add_argument("--records-per-partition", type=int, default=250_000)
    parser.add_argument("--only", choices=("bound", "batch"))
    parser.add_argument("--local-finish-incidences", type=int, help="passed to the Beam runs (default: madp's)")
    parser.add_argument("--records-per-file", type=int, help="Parquet input files scaled (default: 4 files)")
    args = parser.parse_args()
    rows = []
    for size in [int(s) for s in args.sizes.split(",")]:
        partitions = max(16, size // args.records_per_partition)
        beam = ["--partitions", str(partitions)]
        if args.local_finish_incidences is not None:
            beam += ["--local-finish-incidences", str(args.local_finish_incidences)]
        with tempfile.TemporaryDirectory(prefix="madp-scale-") as work:
            data = os.path.join(work, "records")
            subprocess.run(
                [sys.executable, "-m", "madp.cli", "-q", "generate", data, "--records", str(size)]
                + ["--graph", "skewed", "--seed", "1", "--features", "4"]
                + ["--shards", str(max(4, size // args.records_per_file) if args.records_per_file else 4)],
                check=True,
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
            )
            row: dict = {"records": size, "partitions": partitions}
            if args.only in (None, "bound"):
                bound = ["bound", data]
                row["bound_local"] = child(bound[0], "local", [data, os.path.join(work, "bound-local"), "-k", "3"])
                row["bound_direct"] = child(
                    bound[0], "DirectRunner", [data, os.path.join(work, "bound-direct"), "-k", "3", *beam]
                )
                direct = json.load(open(os.path.join(work, "bound-direct", "report.json")))
                row["bound_iterations"] = [run["iterations"] for run in direct["pipeline_runs"]]
                row["bound_finished_locally"] = [run["finished_locally_incidences"] for run in direct["pipeline_runs"]]
            if args.only in (None, "batch"):
                selected = os.path.join(work, "bound-local")
                if not os.path.exists(selected):
                    child("bound", "local", [data, selected, "-k", "3"])
                batch = [selected, data, "--steps", "1000", "--batch-size", "1000", "--min-sep", "4"]
                row["batch_local"] = child("batch", "local", [*batch[:2], os.path.join(work, "b-local"), *batch[2:]])
                row["batch_direct"] = child(
                    "batch", "DirectRunner", [*batch[:2], os.path.join(work, "b-direct"), *batch[2:], *beam]
                )
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{'records':>12}{'job':>7}{'local s':>9}{'direct s':>10}{'ratio':>7}{'driver MB':>11}{'worker MB':>11}")
    for row in rows:
        for job in ("bound", "batch"):
            if f"{job}_direct" in row:
                local, direct = row[f"{job}_local"], row[f"{job}_direct"]
                print(
                    f"{row['records']:>12,}{job:>7}{local['wall_s']:>9.1f}{direct['wall_s']:>10.1f}"
                    f"{direct['wall_s'] / local['wall_s']:>7.1f}{direct['driver_peak_mb']:>11}"
                    f"{direct['largest_worker_peak_mb']:>11}"
                )
        for run in row.get("bound_iterations", []):
            first = next((one["shuffled_bytes"] for one in run if one["iteration"] == 1), None)
            for one in run:
                share = f" ({one['shuffled_bytes'] / first:.0%} of round 1)" if first else ""
                print(
                    f"    iteration {one['iteration']}: {one['active_incidences']:,} undecided incidences, "
                    f"{one['shuffled_bytes'] / 1e6:,.1f} MB shuffled{share}"
                )


if __name__ == "__main__":
    main()
