"""The outputs of `madp batch` as the trainer sees them: files, schema, report (no TensorFlow)."""

from __future__ import annotations

import dataclasses
import json

from madp.core import storage
from madp.core.batch_files import batch_files, read_batch_report
from madp.core.errors import InputError
from madp.core.reports import BatchReport


@dataclasses.dataclass(frozen=True)
class Batches:
    directory: str
    files: tuple[str, ...]
    schema: dict
    report: BatchReport

    @property
    def steps(self) -> int:
        return int(self.report.steps)

    @property
    def expected_batch_size(self) -> float:
        """The divisor of the noisy gradient sum: the target expected size, never the realized one."""
        return float(self.report.parameters.batch_size)

    @property
    def max_rows_per_step(self) -> int:
        """Rows of the largest step in the files: B_max where steps are padded to it, else the largest batch."""
        return self.report.max_rows_per_step

    @property
    def selection(self) -> str:
        """The bound output the batches were made from (`madp bound`'s OUTPUT): the private trainings on
        every batch output made from it are entered in its ledger, under its lock."""
        return self.report.selected


READER = "reading the batches (madp train, or the Python API)"  # what a reader's mark on them says


def open_batches(directory: str) -> Batches:
    """The batches of a local or remote (gs://, s3://, hdfs://) finished `madp batch` output: exactly
    the files its report lists, each with its recorded size and SHA-256; refused while another process
    holds the folder to write it (the files, the schema and the report are read under a reader's mark,
    so that all three are of one `madp batch`)."""
    with storage.reading(directory, READER):
        if storage.kind(storage.join(directory, "schema.json")) != "file":
            raise InputError(
                f"{directory}: not a `madp batch` output (needs batches-*.tfrecord, schema.json, report.json)"
            )
        files = tuple(batch_files(directory))
        schema = json.loads(storage.read_text(storage.join(directory, "schema.json")))
        return Batches(directory, files, schema, read_batch_report(directory))


def unchanged(batches: Batches) -> None:
    """Refuse batches that a `madp batch` rewrote since `open_batches` read them (their report, which lists
    every file's SHA-256, differs): their files are no longer those of the report they were opened with.
    Call it under a reader's mark (`storage.reading`), which then keeps any writer out while they are read."""
    if read_batch_report(batches.directory) != batches.report:
        raise InputError(
            f"{batches.directory}: rewritten since it was opened (its report.json changed: a `madp batch` wrote "
            f"other batches there); open it again (open_batches) to read what it holds now"
        )
