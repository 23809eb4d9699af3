"""How the engines that move partitions (Beam's pipelines, Spark) divide a job: the options they share,
declared once (`madp.core.options.option`) with the same flags, defaults and checks on every engine."""

from __future__ import annotations

import dataclasses

from madp.core.errors import InputError
from madp.core.options import option

MIN_SPLIT_BYTES = 1024
DEFAULT_PARTITIONS = 16  # Beam's, whose graph is built before the input is read
# On Spark, without --partitions: one partition per so many input rows, so that a partition's elements
# and a task's memory keep their size as the input grows instead of growing with it; and at least
# TASKS_PER_CORE per core of the cluster. Each job takes as many rows as its own tasks' memory allows,
# and no fewer: every PySpark task costs about 50-60 ms of CPU whatever it holds (a task's Python worker
# set up, its functions sent), a job runs some 15 stages of one task per partition, and a shuffle moves a
# block from every partition to every other, partitions squared, each costing the executors' JVMs about
# as much as its bytes. The bounding's build holds about 0.35 KB per record in a Python worker: at 10M
# records 15 partitions peaked at 400 MB and bound in 72 s, 10 at 495 MB in 65 s; at 100M, 143 bound in
# 793 s. The batching holds less per record, and its shuffles cost more per partition: at 100M, 143
# partitions batched in 572 s where 100 took 398 s.
BOUND_RECORDS_PER_PARTITION = 700_000
BATCH_RECORDS_PER_PARTITION = 1_000_000
TASKS_PER_CORE = 2  # Spark's tuning guide: 2-3 tasks per core


@dataclasses.dataclass(frozen=True)
class PartitionOptions:
    """The work's division on a partitioned engine (each field its `--flag`; the underscore spellings are
    Beam's style, taken too): record and user partitions, the size of an input file's splits, and when
    one worker finishes the bounding. Checked as built."""

    partitions: int | None = option(
        None,
        help="madp: record and user partitions, the columnar units of work the runner spreads over "
        "workers (use several per worker core, and enough that one fits a worker's memory; default: "
        f"{DEFAULT_PARTITIONS} on Beam; on Spark one per {BOUND_RECORDS_PER_PARTITION:,} input rows for madp "
        f"bound and {BATCH_RECORDS_PER_PARTITION:,} for madp batch, at least "
        f"{TASKS_PER_CORE} per core of the cluster)",
    )
    input_split_bytes: int = option(
        64 << 20,
        aliases=("--input_split_bytes",),
        help="madp: an uncompressed JSON Lines or a Parquet input file larger than this is read in "
        "splits of about this size, by as many workers (a gzipped file is read whole)",
    )
    local_finish_incidences: int = option(
        2_000_000,
        aliases=("--local_finish_incidences",),
        help="madp bound: once at most this many undecided incidences are left, one worker finishes "
        "the bounding with the local kernels (about 60 bytes each)",
    )

    def __post_init__(self) -> None:
        if self.partitions is not None and self.partitions < 1:
            raise InputError("--partitions must be at least 1")
        if self.input_split_bytes < MIN_SPLIT_BYTES:
            raise InputError(
                f"--input-split-bytes must be at least {MIN_SPLIT_BYTES}: tiny splits read a file many times over"
            )
        if self.local_finish_incidences < 0:
            raise InputError("--local-finish-incidences must be at least 0")

    def partitions_for(self, records: int | None, cores: int | None = None, rows_each: int | None = None) -> int:
        """The partitions of a job: --partitions where given; else, for an input of `records` rows on a
        cluster of `cores` cores (Spark's default parallelism), one per `rows_each` rows (the job's
        `*_RECORDS_PER_PARTITION`) and at least TASKS_PER_CORE per core; DEFAULT_PARTITIONS where these
        are not known before the job is built (Beam's graph)."""
        if self.partitions is not None:
            return self.partitions
        if records is None or cores is None or rows_each is None:
            return DEFAULT_PARTITIONS
        return max(TASKS_PER_CORE * cores, -(-records // rows_each))
