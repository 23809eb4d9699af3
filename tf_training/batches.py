"""The outputs of `madp batch` as the trainer sees them: files, schema, report (no TensorFlow)."""
from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os

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
        hashes = {}
        for path in self.files:
            digest = hashlib.sha256()
            with open(path, "rb") as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(block)
            hashes[os.path.basename(path)] = digest.hexdigest()
        return hashes


def open_batches(directory: str) -> Batches:
    files = tuple(sorted(glob.glob(os.path.join(directory, "batches-*.tfrecord"))))
    missing = [name for name in ("schema.json", "report.json") if not os.path.exists(os.path.join(directory, name))]
    if not files or missing:
        raise InputError(f"{directory}: not a `madp batch` output (needs batches-*.tfrecord, schema.json, report.json)")
    with open(os.path.join(directory, "schema.json")) as handle:
        schema = json.load(handle)
    with open(os.path.join(directory, "report.json")) as handle:
        report = json.load(handle)
    return Batches(directory, files, schema, report)
