"""What a Beam job on the DirectRunner needs of the memory this process may use, checked before Beam is
imported. The DirectRunner runs the whole job in this process (and, in `multi_processing` mode, in
worker processes on this machine), so the machine's memory, or the container's limit if smaller
(`errors.memory_limit`), is what the job must fit in; a job past a container's limit is killed without
a word. Importing Beam alone takes this process past 200 MiB, so the check comes first."""

from __future__ import annotations

import argparse
import os

from madp.core.errors import check_memory

# Peak resident memory of `madp bound` on 1,000 records on the in-memory DirectRunner: the interpreter
# with Beam, pyarrow and numpy loaded, and the runner's own state (measured 338 MiB; 378 MiB at 20,000
# records, 573 MiB at 200,000). What the job's data adds comes on top.
DIRECT_RUNNER_BYTES = 330 << 20
# Resident memory of each SDK worker process of `--direct_running_mode multi_processing`, Beam loaded
# (measured about 350 MiB each, two workers bounding 20,000 records).
SDK_WORKER_BYTES = 300 << 20
BEAM_CLUSTER = "run it on a Beam cluster (--runner DataflowRunner, FlinkRunner, SparkRunner, ...)"


def _direct_processes(beam_args: list[str]) -> int | None:
    """The worker processes a job of these Beam arguments starts beside this one on the DirectRunner
    (0 in its in-process modes); None on any other runner, whose workers are not this machine's."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--runner", default="DirectRunner")
    parser.add_argument("--direct_running_mode", default="in_memory")
    parser.add_argument("--direct_num_workers", default="1")
    known, _ = parser.parse_known_args(beam_args)
    if known.runner != "DirectRunner":
        return None
    if known.direct_running_mode != "multi_processing":
        return 0
    try:
        workers = int(known.direct_num_workers)
    except ValueError:  # Beam names the option when it parses it
        return 0
    return workers if workers > 0 else os.cpu_count() or 1  # 0: one per core, as Beam does


def check_direct_runner_memory(beam_args: list[str], job: str, data_bytes: float = 0.0, data: str = "") -> None:
    """Refuse, before Beam is imported, a DirectRunner job (`job`, e.g. "madp bound") whose footprint (the
    runner's, its worker processes', and `data_bytes`, what the job holds as the local engine estimates it,
    described by `data`) is more than half of the memory this process may use; other runners pass."""
    workers = _direct_processes(beam_args)
    if workers is None:
        return
    needed = DIRECT_RUNNER_BYTES + workers * SDK_WORKER_BYTES + data_bytes
    where = "in this process" + (f" and {workers} worker processes" if workers else "")
    check_memory(
        needed,
        f"{job} on the DirectRunner ({where}{', ' + data if data else ''}) holds",
        f"raise the memory limit, or {BEAM_CLUSTER}",
    )
