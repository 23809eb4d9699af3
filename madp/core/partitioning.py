"""How the engines that move partitions (Beam's pipelines, Spark) divide a job: the options they share,
declared once (`madp.core.options.option`) with the same flags, defaults and checks on every engine."""

from __future__ import annotations

import dataclasses

from madp.core.errors import InputError
from madp.core.options import option

MIN_SPLIT_BYTES = 1024
DEFAULT_PARTITIONS = 16  # Beam's, whose graph is built before the input is read; the least on Spark
# On Spark, without --partitions: one partition per this many input rows, so that a partition's
# elements keep their size as the input grows (the largest packed user partition of 250,000 skewed
# records is about 9 MB) instead of growing with it to hundreds of MB at 100M records.
RECORDS_PER_PARTITION = 250_000


@dataclasses.dataclass(frozen=True)
class PartitionOptions:
    """The work's division on a partitioned engine (each field its `--flag`; the underscore spellings are
    Beam's style, taken too): record and user partitions, the size of an input file's splits, and when
    one worker finishes the bounding. Checked as built."""

    partitions: int | None = option(
        None,
        help="madp: record and user partitions, the columnar units of work the runner spreads over "
        "workers (use several per worker core, and enough that one fits a worker's memory; default: "
        f"{DEFAULT_PARTITIONS} on Beam; on Spark one per {RECORDS_PER_PARTITION:,} input rows, at least "
        f"{DEFAULT_PARTITIONS})",
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

    def partitions_for(self, records: int | None) -> int:
        """The partitions of a job: --partitions where given; else, for an input of `records` rows,
        one per RECORDS_PER_PARTITION of them, and DEFAULT_PARTITIONS where the count is not
        known before the job is built (`records` None) or gives fewer."""
        if self.partitions is not None:
            return self.partitions
        return max(DEFAULT_PARTITIONS, -(-(records or 0) // RECORDS_PER_PARTITION))
