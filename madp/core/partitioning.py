"""How the engines that move partitions (Beam's pipelines, Spark) divide a job: the options they share,
declared once (`madp.core.options.option`) with the same flags, defaults and checks on every engine."""

from __future__ import annotations

import dataclasses

from madp.core.errors import InputError
from madp.core.options import option

MIN_SPLIT_BYTES = 1024


@dataclasses.dataclass(frozen=True)
class PartitionOptions:
    """The work's division on a partitioned engine (each field its `--flag`; the underscore spellings are
    Beam's style, taken too): record and user partitions, the size of an input file's splits, and when
    one worker finishes the bounding. Checked as built."""

    partitions: int = option(
        16,
        help="madp: record and user partitions, the columnar units of work the runner spreads over "
        "workers (use several per worker core, and enough that one fits a worker's memory)",
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
        if self.partitions < 1:
            raise InputError("--partitions must be at least 1")
        if self.input_split_bytes < MIN_SPLIT_BYTES:
            raise InputError(
                f"--input-split-bytes must be at least {MIN_SPLIT_BYTES}: tiny splits read a file many times over"
            )
        if self.local_finish_incidences < 0:
            raise InputError("--local-finish-incidences must be at least 0")
