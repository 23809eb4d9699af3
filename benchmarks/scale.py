"""Scale benchmark of madp on Spark: bounding and batching skewed records of growing size on a Spark
standalone cluster on this machine (`madp.tools.spark_standalone`: a master and two one-core workers),
each job against `--runner local` in the same run.

For each size: generate the skewed graph (`madp generate --graph skewed`), bound it (K = 3) and batch
the selection (T = 1000, B = 1000, b = 4, `--seed 1` so that both engines draw the same batches), once
with `--runner local` and once with `--runner pyspark` on the cluster, and check that both wrote the
same files byte for byte. Where the local engine refuses a size up front (its memory check: 100M records
on this machine), Spark runs alone and `madp verify-bound` and `madp verify-batches` check its outputs
instead (in buckets on disk; timed and measured as jobs of their own). Each job is a child process; a
thread samples, every 0.2 s, the resident memory and CPU time of every process of each role, told apart
by command line and parentage:

- driver Python: the `madp` process itself (the local engine's only process);
- driver JVM: the Java process below it (PySpark's gateway, SparkSubmit);
- executor JVMs: the cluster workers' children (CoarseGrainedExecutorBackend);
- Python workers: the processes below the executors (`pyspark.daemon` and the workers it forks).

A role's peak is that of its largest process (`peak MB`) and of its processes together at one sample
(`sum MB`; forked Python workers share pages with their daemon, so the sum overstates them); a
role's CPU time is its processes' user and system time, which a busy machine inflates less than
wall time. Every Spark run keeps Spark's event log, from which the benchmark reads where the time
went: each stage's wall time, its tasks' run, deserialization and GC time, and the bytes it shuffled.

    python benchmarks/scale.py [--sizes 1000000,10000000] [--only bound|batch] [--partitions N]
        [--worker-memory 4g] [--executor-memory 3g] [--keep DIR]
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from madp.tools.spark_standalone import SparkCluster, processes, spark_cluster  # noqa: E402

ROLES = ("driver_python", "driver_jvm", "executor_jvms", "python_workers")
SAMPLE_SECONDS = 0.2
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# a seed, so that both engines draw the same batches (without one, each run draws a secret key of its own)
BATCH_ARGUMENTS = ["--steps", "1000", "--batch-size", "1000", "--min-sep", "4", "--seed", "1"]
MAX_CONTRIBUTIONS = "3"
JOBS = ("bound", "batch")
MEMORY_REFUSAL = "in memory, more than half of"  # `check_memory`'s refusal of an input too large to hold


def _descendants(root: int, parents: dict[int, int]) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    found, frontier = set(), [root]
    while frontier:
        for child in children.get(frontier.pop(), []):
            found.add(child)
            frontier.append(child)
    return found


def roles(driver: int, cluster: SparkCluster | None) -> dict[str, set[int]]:
    """The processes of each role now (see the module's docstring)."""
    found = processes()
    parents = {pid: process.parent for pid, process in found.items()}
    below_driver = _descendants(driver, parents)
    by_role = {
        "driver_python": {driver},
        "driver_jvm": {pid for pid in below_driver if "java" in found[pid].command.split(" ", 1)[0]},
        "executor_jvms": set(),
        "python_workers": set(),
    }
    if cluster is not None:
        executors = set(cluster.executors(table=found))
        by_role["executor_jvms"] = executors
        by_role["python_workers"] = set().union(*(_descendants(pid, parents) for pid in executors))
    return by_role


def _cpu_seconds(pid: int) -> float:
    """The CPU time (user and system) a process has used so far."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime: fields 14 and 15 of stat


def _rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class Run(NamedTuple):
    """One job's wall time and, per role, the peak RSS of its largest process and of all its processes
    together (MB), and the CPU time its processes used (as last sampled: a process's last 0.2 s may be
    missed), which a busy machine does not inflate as it does wall time."""

    wall_s: float
    peak_mb: dict[str, int]
    sum_mb: dict[str, int]
    cpu_s: dict[str, float]

    def to_json(self) -> dict:
        return {"wall_s": self.wall_s, "peak_mb": self.peak_mb, "sum_mb": self.sum_mb, "cpu_s": self.cpu_s}


class JobFailed(Exception):
    """A job that exited with an error: its exit status and the end of its stderr."""

    def __init__(self, command: str, returncode: int, stderr: str):
        super().__init__(f"{command} failed with exit status {returncode}:\n{stderr}")
        self.stderr = stderr

    @property
    def refused_for_memory(self) -> str | None:
        """The error line where the job refused its input up front as too large to hold
        (`madp.core.errors.check_memory`), else None."""
        lines = [line for line in self.stderr.splitlines() if MEMORY_REFUSAL in line]
        return lines[-1] if lines else None


def run_job(job: str, arguments: list[str], runner: list[str], cluster: SparkCluster | None) -> Run:
    """`madp JOB ARGUMENTS --runner ...` in a child process, its roles' memory sampled as it runs."""
    command = [sys.executable, "-m", "madp.cli", "-q", job, *arguments, *runner]
    environment = {**os.environ, "PYTHONPATH": ROOT, "SPARK_LOCAL_IP": "127.0.0.1"}
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=environment)
    peak = dict.fromkeys(ROLES, 0)
    total = dict.fromkeys(ROLES, 0)
    cpu: dict[str, dict[int, float]] = {role: {} for role in ROLES}  # by process, as last sampled
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            for role, pids in roles(process.pid, cluster).items():
                sizes = [_rss_kb(pid) for pid in pids]
                peak[role] = max(peak[role], *sizes, 0)
                total[role] = max(total[role], sum(sizes))
                for pid in pids:
                    cpu[role][pid] = max(cpu[role].get(pid, 0.0), _cpu_seconds(pid))
            done.wait(SAMPLE_SECONDS)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _, err = process.communicate()
    wall = time.perf_counter() - started
    done.set()
    sampler.join()
    if process.returncode:
        raise JobFailed(f"madp {job} {' '.join(runner)}", process.returncode, err.decode(errors="replace")[-4000:])
    return Run(
        round(wall, 2),
        {role: round(kb / 1024) for role, kb in peak.items()},
        {role: round(kb / 1024) for role, kb in total.items()},
        {role: round(sum(seconds.values()), 1) for role, seconds in cpu.items()},
    )


def spark_runner(cluster: SparkCluster, events: str | None, args: argparse.Namespace) -> list[str]:
    """The options of a `--runner pyspark` job on the cluster, its event log kept under `events` (if any)."""
    settings = [
        f"spark.executor.memory={args.executor_memory}",
        "spark.driver.host=127.0.0.1",
        "spark.scheduler.minRegisteredResourcesRatio=1.0",  # both executors take part from the first stage
        "spark.scheduler.maxRegisteredResourcesWaitingTime=60s",
    ]
    if events:
        settings += [
            "spark.eventLog.enabled=true",
            f"spark.eventLog.dir=file://{events}",
            "spark.eventLog.rolling.enabled=false",  # one plain file of JSON lines
            "spark.eventLog.compress=false",
        ]
    options = ["--runner", "pyspark", "--spark-master", cluster.master_url]
    for setting in settings:
        options += ["--spark-conf", setting]
    return options + (["--partitions", str(args.partitions)] if args.partitions else [])


def _events(folder: str) -> Iterator[dict]:
    """The events of the one event log in `folder`."""
    (name,) = os.listdir(folder)
    with open(os.path.join(folder, name)) as log:
        for line in log:
            yield json.loads(line)


def stage_profile(folder: str) -> list[dict]:
    """Each completed stage of the job's event log: its name (the action's call site), tasks, wall
    time, and its tasks' summed run, deserialization, GC and result serialization time and shuffle
    bytes, the slowest stage first."""
    tasks: dict[tuple[int, int], dict[str, float]] = {}
    stages = []
    for event in _events(folder):
        kind = event["Event"]
        if kind == "SparkListenerTaskEnd" and event.get("Task Metrics"):
            metrics = event["Task Metrics"]
            summed = tasks.setdefault((event["Stage ID"], event["Stage Attempt ID"]), {})
            for name, value in (
                ("run_s", metrics["Executor Run Time"] / 1e3),
                ("deserialize_s", metrics["Executor Deserialize Time"] / 1e3),
                ("gc_s", metrics["JVM GC Time"] / 1e3),
                ("result_serialize_s", metrics["Result Serialization Time"] / 1e3),
                ("shuffle_write_mb", metrics["Shuffle Write Metrics"]["Shuffle Bytes Written"] / 1e6),
                ("shuffle_read_mb", _shuffle_read(metrics["Shuffle Read Metrics"]) / 1e6),
                ("spill_mb", metrics["Disk Bytes Spilled"] / 1e6),
            ):
                summed[name] = summed.get(name, 0.0) + value
        elif kind == "SparkListenerStageCompleted":
            info = event["Stage Info"]
            summed = tasks.get((info["Stage ID"], info["Stage Attempt ID"]), {})
            stages.append(
                {
                    "stage": info["Stage ID"],
                    "name": _call_site(info["Stage Name"]),
                    "tasks": info["Number of Tasks"],
                    "wall_s": round((info["Completion Time"] - info["Submission Time"]) / 1e3, 2),
                    **{name: round(value, 2) for name, value in summed.items()},
                }
            )
    return sorted(stages, key=lambda stage: -stage["wall_s"])


def _call_site(name: str) -> str:
    """A stage's name, its file named without its folder: `groupByKey at bound.py:295`."""
    action, at, path = name.partition(" at ")
    return f"{action}{at}{os.path.basename(path)}"


def _shuffle_read(metrics: dict) -> int:
    return metrics["Remote Bytes Read"] + metrics["Local Bytes Read"]


def same_files(first: str, second: str) -> bool:
    """Whether two outputs hold the same files byte for byte, their reports (which name the runner and
    its timings) and work folders aside."""

    def listed(root: str) -> list[str]:
        return sorted(
            os.path.relpath(os.path.join(folder, name), root)
            for folder, _, names in os.walk(root)
            for name in names
            if not name.startswith(("report", ".")) and "_work" not in folder
        )

    names = listed(first)
    _, mismatched, unreadable = filecmp.cmpfiles(first, second, names, shallow=False)
    return names == listed(second) and not mismatched and not unreadable


def measure(size: int, work: str, cluster: SparkCluster, args: argparse.Namespace) -> dict:
    """Both jobs at one size, each with `--runner local` and on the cluster."""
    data = os.path.join(work, "records")
    generate = [data, "--records", str(size), "--graph", "skewed", "--seed", "1", "--features", "4"]
    generated = run_job("generate", [*generate, "--shards", str(max(4, size // 2_500_000))], [], None)
    row: dict = {"records": size, "generate": generated.to_json()}
    outputs = {job: {engine: os.path.join(work, f"{job}-{engine}") for engine in ("local", "spark")} for job in JOBS}
    jobs = {
        "bound": lambda output: [data, output, "-k", MAX_CONTRIBUTIONS],
        "batch": lambda output: [selection(), data, output, *BATCH_ARGUMENTS],
    }
    verifications = {
        "bound": lambda: [data, outputs["bound"]["spark"], "-k", MAX_CONTRIBUTIONS],
        "batch": lambda: (
            [outputs["batch"]["spark"], data, "--selected", selection(), "-k", MAX_CONTRIBUTIONS]
            + ["--min-sep", BATCH_ARGUMENTS[BATCH_ARGUMENTS.index("--min-sep") + 1]]
        ),
    }

    def selection() -> str:
        """The selection the batching reads: the local engine's, or Spark's where the local one refused."""
        return next(path for path in outputs["bound"].values() if os.path.exists(os.path.join(path, "report.json")))

    if args.only == "batch":  # the selection it reads, untimed
        try:
            run_job("bound", jobs["bound"](outputs["bound"]["local"]), ["--runner", "local"], None)
        except JobFailed as failed:
            if not failed.refused_for_memory:
                raise
            run_job("bound", jobs["bound"](outputs["bound"]["spark"]), spark_runner(cluster, None, args), cluster)
    for job in [args.only] if args.only else JOBS:
        arguments, output = jobs[job], outputs[job]
        one: dict = {}
        try:
            one["local"] = run_job(job, arguments(output["local"]), ["--runner", "local"], None).to_json()
        except JobFailed as failed:
            if not failed.refused_for_memory:
                raise
            one["local"] = {"refused": failed.refused_for_memory}
        events = os.path.join(work, f"events-{job}")
        os.makedirs(events)
        spark = run_job(job, arguments(output["spark"]), spark_runner(cluster, events, args), cluster)
        one["spark"] = spark.to_json()
        if "refused" in one["local"]:
            one["verified"] = run_job(f"verify-{job}", verifications[job](), [], None).to_json()
        else:
            one["ratio"] = round(spark.wall_s / one["local"]["wall_s"], 2)
            one["same_files"] = same_files(output["local"], output["spark"])
        one["stages"] = stage_profile(events)
        row[job] = one
    return row


def print_table(rows: list[dict]) -> None:
    print(f"\n{'records':>12}{'job':>7}{'local s':>9}{'spark s':>9}{'ratio':>7}{'same':>6}", end="")
    print(f"{'local MB':>10}" + "".join(f"{role + ' MB':>18}" for role in ROLES))
    for row in rows:
        generated = row["generate"]
        print(
            f"{row['records']:>12,}{'generate':>9} {generated['wall_s']:.1f} s, "
            f"peak {generated['peak_mb']['driver_python']:,} MB"
        )
        for job in [job for job in JOBS if job in row]:
            one = row[job]
            local, spark = one["local"], one["spark"]
            if "refused" in local:
                print(f"{row['records']:>12,}{job:>7}{'refused':>9}{spark['wall_s']:>9.1f}{'':>19}", end="")
            else:
                print(
                    f"{row['records']:>12,}{job:>7}{local['wall_s']:>9.1f}{spark['wall_s']:>9.1f}{one['ratio']:>6.1f}x"
                    f"{'yes' if one['same_files'] else 'NO':>6}{local['peak_mb']['driver_python']:>10,}",
                    end="",
                )
            print("".join(f"{spark['peak_mb'][role]:>10,} ({spark['sum_mb'][role]:>5,})" for role in ROLES))
            if "refused" in local:
                verified = one["verified"]
                print(f"{'':>19}local: {local['refused']}")
                print(
                    f"{'':>19}verify-{job} passed: {verified['wall_s']:.1f} s, "
                    f"peak {verified['peak_mb']['driver_python']:,} MB"
                )
            for stage in one["stages"][:5]:
                print(
                    f"{'':>19}stage {stage['stage']:>3} {stage['name'][:30]:<30} {stage['tasks']:>4} tasks "
                    f"{stage['wall_s']:>7.1f} s  run {stage.get('run_s', 0):.1f} s  "
                    f"shuffle write {stage.get('shuffle_write_mb', 0):,.1f} MB"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1000000,10000000")
    parser.add_argument("--only", choices=("bound", "batch"))
    parser.add_argument("--partitions", type=int, help="passed to the Spark jobs (default: madp's)")
    parser.add_argument("--workers", type=int, default=2, help="one-core workers of the cluster")
    parser.add_argument("--worker-memory", default="4g", help="each worker's memory for its executors")
    parser.add_argument("--executor-memory", default="3g", help="spark.executor.memory")
    parser.add_argument("--keep", help="a folder to keep the data, outputs and event logs in (default: removed)")
    args = parser.parse_args()
    rows = []
    with spark_cluster(args.workers, 1, args.worker_memory, {**os.environ, "PYTHONPATH": ROOT}) as cluster:
        for size in [int(s) for s in args.sizes.split(",")]:
            if args.keep:
                work = os.path.join(args.keep, str(size))
                os.makedirs(work)
                rows.append(measure(size, work, cluster, args))
            else:
                with tempfile.TemporaryDirectory(prefix="madp-scale-") as work:
                    rows.append(measure(size, work, cluster, args))
            print(json.dumps(rows[-1]), flush=True)
    print_table(rows)


if __name__ == "__main__":
    main()
