"""The outputs of `madp batch` as the trainer sees them: files, schema, report (no TensorFlow)."""

from __future__ import annotations

import dataclasses
import json

from madp.core import storage
from madp.core.batch_files import batch_files
from madp.core.errors import InputError
from madp.core.selection import read_report


@dataclasses.dataclass(frozen=True)
class Batches:
    directory: str
    files: tuple[str, ...]
    schema: dict
    report: dict

    @property
    def steps(self) -> int:
        return int(self.report["steps"])

    @property
    def expected_batch_size(self) -> float:
        """The divisor of the noisy gradient sum: the target expected size, never the realized one."""
        return float(self.report["parameters"]["batch_size"])

    @property
    def max_rows_per_step(self) -> int:
        """Rows of the largest step in the files: B_max where steps are padded to it, else the largest batch."""
        return max_rows_per_step(self.report)

    @property
    def selection(self) -> str:
        """The bound output the batches were made from (`madp bound`'s OUTPUT): the private trainings on
        every batch output made from it are entered in its ledger, under its lock."""
        return str(self.report.get("selected") or "")


def max_rows_per_step(report: dict) -> int:
    """`Batches.max_rows_per_step` of a batch report."""
    return int(report["parameters"].get("max_batch_size") or report["written_batch_sizes"]["max"])


def open_batches(directory: str) -> Batches:
    """The batches of a local or remote (gs://, s3://, hdfs://) finished `madp batch` output: exactly
    the files its report lists, each with its recorded size and SHA-256."""
    if storage.kind(storage.join(directory, "schema.json")) != "file":
        raise InputError(f"{directory}: not a `madp batch` output (needs batches-*.tfrecord, schema.json, report.json)")
    files = tuple(batch_files(directory))
    schema = json.loads(storage.read_text(storage.join(directory, "schema.json")))
    return Batches(directory, files, schema, read_report(directory, "batch"))
