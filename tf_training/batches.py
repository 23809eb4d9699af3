"""The outputs of `madp batch` as the trainer sees them: files, schema, report (no TensorFlow)."""
from __future__ import annotations

import dataclasses
import json
import posixpath

from madp import storage
from madp.records import InputError


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
        return int(self.report["parameters"].get("max_batch_size") or self.report["written_batch_sizes"]["max"])

    def file_hashes(self) -> dict[str, str]:
        return {posixpath.basename(path): storage.sha256(path) for path in self.files}


def open_batches(directory: str) -> Batches:
    """The batches of a local or remote (gs://, s3://, hdfs://) `madp batch` output."""
    listed = storage.list_files(directory, recursive=False) if storage.kind(directory) == "directory" else []
    files = tuple(path for path in listed if posixpath.basename(path).startswith("batches-")
                  and path.endswith(".tfrecord"))
    missing = [name for name in ("schema.json", "report.json") if storage.kind(storage.join(directory, name)) != "file"]
    if not files or missing:
        raise InputError(f"{directory}: not a `madp batch` output (needs batches-*.tfrecord, schema.json, report.json)")
    schema = json.loads(storage.read_text(storage.join(directory, "schema.json")))
    report = json.loads(storage.read_text(storage.join(directory, "report.json")))
    return Batches(directory, files, schema, report)
