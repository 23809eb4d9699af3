"""The outputs of `madp batch` as the trainer sees them: files, schema, report (no TensorFlow)."""

from __future__ import annotations

import dataclasses

from madp.core import output_lock, storage
from madp.core.batch_files import BatchSchema, batch_files, read_batch_report, read_schema
from madp.core.errors import InputError
from madp.core.reports import BatchReport


@dataclasses.dataclass(frozen=True)
class Batches:
    """A finished `madp batch` output as `open_batches` read it, which `calibrate`, `read_steps`,
    `steps_dataset` and `madp train` take. Frozen; its properties read its report.

    Args:
        directory: the output's directory (local, or gs://, s3://, hdfs://).
        files: its batch files (`batches-*.tfrecord`), exactly those its report lists.
        schema: schema.json, checked (`madp.core.batch_files.BatchSchema`): each feature's dtype and shape,
            and how the rows are ordered.
        report: report.json's content, checked (`madp.core.reports.BatchReport`).

    Returns:
        Made by `open_batches`, not by hand: `steps` (T), `expected_batch_size` (B, the divisor of the
        noisy gradient sum), `max_rows_per_step` (B_max or the largest batch) and `selection` (the
        `madp bound` output whose trainings ledger its private trainings enter).

    Raises:
        Nothing: `open_batches` checks what it reads.

    Example::

        batches = open_batches("demo-output/batches")
        batches.steps, batches.expected_batch_size, batches.max_rows_per_step  # e.g. (12, 8.0, 16)
    """

    directory: str
    files: tuple[str, ...]
    schema: BatchSchema
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
    """The batches of a local or remote (gs://, s3://, hdfs://) finished `madp batch` output.

    Exactly the files its report lists, each with its recorded size and SHA-256; refused while another
    process holds the folder to write it (the files, the schema and the report are read under a reader's
    mark, so that all three are of one `madp batch`).

    Args:
        directory: a `madp batch` (or `madp.batch`) output directory.

    Returns:
        The `Batches`: their directory, files, schema and report.

    Raises:
        madp.core.errors.InputError: a directory that is not a finished `madp batch` output (no
            schema.json, report.json or batch files, or files other than its report lists), or one that
            another process holds to write it; the message names the directory or file.

    Example:
        >>> import madp, tempfile
        >>> from madp.tools.data.synthetic import GraphSpec, generate, write_dataset
        >>> from madp.training import open_batches
        >>> work, spec = tempfile.mkdtemp(), GraphSpec(records=400, features=4, seed=1)
        >>> _ = write_dataset(generate(spec), spec, f"{work}/records.parquet", shards=1)
        >>> _ = madp.bound(f"{work}/records.parquet", f"{work}/bounded", max_contributions=3)
        >>> _ = madp.batch(f"{work}/bounded", f"{work}/records.parquet", f"{work}/batches", steps=12,
        ...                batch_size=8, min_sep=2, seed=0)  # seed: reproducible, NOT private
        >>> batches = open_batches(f"{work}/batches")
        >>> batches.steps, batches.expected_batch_size, batches.max_rows_per_step
        (12, 8.0, 16)
        >>> sorted(batches.schema.features), batches.selection == f"{work}/bounded"
        (['features', 'id', 'label', 'step', 'weight'], True)
    """
    with output_lock.reading(directory, READER):
        if storage.kind(storage.join(directory, "schema.json")) != "file":
            raise InputError(
                f"{directory}: not a `madp batch` output (needs batches-*.tfrecord, schema.json, report.json)"
            )
        files = tuple(batch_files(directory))
        return Batches(directory, files, read_schema(directory), read_batch_report(directory))


def unchanged(batches: Batches) -> None:
    """Refuse batches that a `madp batch` rewrote since `open_batches` read them (their report, which lists
    every file's SHA-256, differs): their files are no longer those of the report they were opened with.
    Call it under a reader's mark (`output_lock.reading`), which then keeps any writer out while they are read."""
    if read_batch_report(batches.directory) != batches.report:
        raise InputError(
            f"{batches.directory}: rewritten since it was opened (its report.json changed: a `madp batch` wrote "
            f"other batches there); open it again (open_batches) to read what it holds now"
        )
