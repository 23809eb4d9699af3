"""The batch files `madp batch` writes and the trainer reads: names, step ranges, rows, padding and the
schema, shared by both engines and by training (so that neither imports the other)."""

from __future__ import annotations

import dataclasses
import json
import posixpath
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa

from madp.core import sampling, storage, tfrecord
from madp.core.columnar import Columnar
from madp.core.errors import InputError
from madp.core.reports import BatchReport
from madp.core.selection import REPORT_FILE, read_manifest, read_report

USER_FEATURE = "user"  # users sampler: the row's user (64-bit hash), for per-user clipping
SCHEMA_FILE = "schema.json"
TRAININGS_FILE = "trainings.jsonl"  # the private trainings on a batch output (madp train), internal
RESERVED_FEATURES = ("step", "id", "weight")
PADDING_ID = -1  # the id of padding rows ("" for string ids); no selected record may have it
# The encoder indexes every byte it places (16 bytes of indices per byte), so rows are encoded in
# chunks of about this many bytes: 65,536 rows of 16 floats, or 512 rows of 2,048 floats.
_ENCODE_BYTES = 1 << 23


def is_list(value_type: pa.DataType) -> bool:
    return pa.types.is_list(value_type) or pa.types.is_large_list(value_type) or pa.types.is_fixed_size_list(value_type)


def incidences_of(offsets: np.ndarray, records: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(position in `records`, flat incidence index) of every user of each listed record."""
    return sampling.expand_ranges(offsets[records], offsets[records + 1] - offsets[records])


def file_of_step(steps: np.ndarray, total_steps: int, files: int) -> np.ndarray:
    """Contiguous step ranges per file, so that file names sort in step order."""
    return (steps * files) // total_steps


def step_range(file: int, total_steps: int, files: int) -> range:
    return range(-(-file * total_steps // files), -(-(file + 1) * total_steps // files))


def batch_file_path(output: str, file: int, files: int) -> str:
    return storage.join(output, f"batches-{file:05d}-of-{files:05d}.tfrecord")


def read_batch_report(output: str) -> BatchReport:
    """The report of a finished `madp batch` OUTPUT, checked (`BatchReport.from_json`)."""
    return BatchReport.from_json(read_report(output, "batch"), storage.join(output, REPORT_FILE))


def batch_files(output: str) -> list[str]:
    """The batch files of a finished `madp batch` output, exactly those its report lists (they sit beside
    the schema, the report and rejects, so only files named like batch files must be listed), each
    whole TFRecords: a file damaged or cut short is refused here, before a training starts, even where
    its listing was rewritten to match it."""
    files = read_manifest(
        output,
        "batch",
        "",
        read_batch_report(output).files,
        lambda name: posixpath.basename(name).startswith("batches-") and name.endswith(".tfrecord"),
    )
    for path in files:
        tfrecord.check_records(path)
    return files


def _padding(value_type: pa.DataType, shape: Sequence[int | None], rows: int) -> pa.Array:
    """`rows` zero values of a content column: 0, 0.0 or empty string, or a list of `shape` of them
    (empty when the length varies)."""
    if is_list(value_type):
        length = shape[0] or 0
        zeros = _padding(value_type.value_type, [], length * rows)
        offsets = pa.array(np.arange(rows + 1, dtype=np.int32) * length)
        padded = (
            pa.FixedSizeListArray.from_arrays(zeros, length)
            if pa.types.is_fixed_size_list(value_type)
            else pa.ListArray.from_arrays(offsets, zeros)
        )
        return padded.cast(value_type)
    if pa.types.is_string(value_type) or pa.types.is_large_string(value_type) or pa.types.is_binary(value_type):
        return pa.array([""] * rows, type=value_type)
    return pa.array(np.zeros(rows), type=pa.float64()).cast(value_type)


@dataclasses.dataclass(frozen=True)
class Feature:
    """One feature of the batches' rows, as their schema.json describes it."""

    name: str  # its key in schema.json's features
    dtype: str  # "float" (float32), "int64" or "bytes" (strings)
    shape: tuple[int | None, ...]  # per row: () a scalar, (16,) a vector, (None,) a list whose length varies

    def to_json(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_json(cls, name: str, data: Mapping[str, Any]) -> Feature:
        return cls(name, data["dtype"], tuple(data["shape"]))


WEIGHT_NOTE = "1.0 real record, 0.0 padding"  # what schema.json says of the weight feature, for its readers


@dataclasses.dataclass(frozen=True)
class BatchSchema:
    """schema.json beside the batch files: every feature of their rows by name (the step, the record's id,
    its weight, the content columns), the steps, B_max (None where steps are not padded) and that rows
    are in step order."""

    features: Mapping[str, Feature]  # each feature of a row by its name: step, id, weight, the content columns
    steps: int  # T: the steps the batch files hold
    max_batch_size: int | None  # B_max: rows per step at most (None: steps are not padded)
    rows_in_step_order: bool = True  # the rows of step t come before those of step t + 1

    def to_json(self) -> dict[str, Any]:
        return {
            "features": {
                name: {**feature.to_json(), **({"note": WEIGHT_NOTE} if name == "weight" else {})}
                for name, feature in self.features.items()
            },
            "steps": self.steps,
            "max_batch_size": self.max_batch_size,
            "rows_in_step_order": self.rows_in_step_order,
        }

    @classmethod
    def from_json(cls, data: Any, where: str) -> BatchSchema:
        """The schema of a parsed schema.json (`where` names it in errors)."""
        try:
            return cls(
                features={name: Feature.from_json(name, feature) for name, feature in data["features"].items()},
                steps=data["steps"],
                max_batch_size=data["max_batch_size"],
                rows_in_step_order=data["rows_in_step_order"],
            )
        except (KeyError, TypeError, AttributeError) as error:
            raise InputError(
                f"{where} is not a batch schema this madp reads ({type(error).__name__}: {error}); re-run madp batch"
            ) from None


@dataclasses.dataclass
class FileRows(Columnar):
    """Rows of one batch file before ordering/truncation: aligned arrays plus content."""

    steps: np.ndarray
    unit_keys: np.ndarray
    record_keys: np.ndarray  # seeded record hash: identifies the record across files
    ids: pa.Array
    content: pa.Table
    user_offsets: np.ndarray  # CSR users (hashes) of each row, for participation statistics
    users: np.ndarray


def file_rows(
    ids: pa.Array,
    content: pa.Table,
    offsets: np.ndarray,
    users: np.ndarray,
    record_keys: np.ndarray,
    record: np.ndarray,
    keys: np.ndarray,
    step: np.ndarray,
) -> FileRows:
    """The rows (record index, unit key, step) of one file, with their ids, content and users."""
    _, flat = incidences_of(offsets, record)
    arity = offsets[record + 1] - offsets[record]
    return FileRows(
        steps=step,
        unit_keys=keys,
        record_keys=record_keys[record],
        ids=ids.take(pa.array(record)),
        content=content.take(pa.array(record)),
        user_offsets=np.concatenate([[0], np.cumsum(arity)]).astype(np.int64),
        users=users[flat],
    )


class FileCounts(NamedTuple):
    """A batch file's rows as the report counts them: the real rows of each step of its range, the
    rows the maximum batch size cut, the padding rows."""

    written: np.ndarray  # per step of the file's range, in order
    truncated: int
    padding: int

    def to_json(self) -> dict[str, Any]:
        return {"written": self.written.tolist(), "truncated": int(self.truncated), "padding": int(self.padding)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FileCounts:
        return cls(np.array(data["written"], dtype=np.int64), data["truncated"], data["padding"])


class WrittenFile(NamedTuple):
    """What writing a batch file tells the statistics: its counts; the user (hash) and step of every
    (written row, user of its record) pair; the record key of every written row."""

    counts: FileCounts
    user_hashes: np.ndarray
    user_steps: np.ndarray
    record_keys: np.ndarray


def write_batch_file(
    path: str,
    rows: FileRows,
    steps: range,
    max_batch_size: int | None,
    content: Mapping[str, Feature],
    write_whole: Callable[[str, Callable[[Any], object]], None] = storage.write_whole,
) -> WrittenFile:
    """Order each step's rows by counter-based priority, keep at most B_max, pad to B_max, write.

    The file's bytes go through `write_whole(path, write)`, whole or not at all: `storage.write_whole`
    in the local engine, Beam's `FileSystems` (`madp.beam.files.write_whole`) in a Beam worker.
    Returns the file's counts and the written rows' (user, step) pairs and record keys, for the statistics.
    """
    keep = sampling.order_and_truncate(
        rows.steps, sampling.truncation_priority(rows.unit_keys, rows.steps), max_batch_size
    )
    step = rows.steps[keep]
    written = np.bincount(step - steps.start, minlength=len(steps)) if len(steps) else np.zeros(0, np.int64)
    columns = {
        "step": pa.array(step, pa.int64()),
        "id": rows.ids.take(pa.array(keep)),
        "weight": pa.array(np.ones(len(keep), np.float32)),
    }
    columns.update(
        {name: rows.content.column(name).combine_chunks().take(pa.array(keep)) for name in rows.content.column_names}
    )
    if max_batch_size is not None:
        pad = max_batch_size - written
        pad_steps = np.repeat(np.arange(steps.start, steps.stop), pad)
        padding = {
            "step": pa.array(pad_steps, pa.int64()),
            "id": pa.array(
                [PADDING_ID if pa.types.is_integer(rows.ids.type) else ""] * len(pad_steps), type=rows.ids.type
            ),
            "weight": pa.array(np.zeros(len(pad_steps), np.float32)),
        }
        padding.update(
            {
                name: _padding(rows.content.schema.field(name).type, content[name].shape, len(pad_steps))
                for name in rows.content.column_names
            }
        )
        # Padding rows go after the real rows of their step.
        order = np.argsort(np.concatenate([step, pad_steps]), kind="stable")
        columns = {name: pa.concat_arrays([columns[name], padding[name]]).take(pa.array(order)) for name in columns}
    rows_written = len(columns["step"])
    row_bytes = sum(column.nbytes for column in columns.values()) / max(rows_written, 1)
    chunk_rows = max(1, int(_ENCODE_BYTES // max(row_bytes, 1)))

    def write(handle) -> None:
        for start in range(0, rows_written, chunk_rows):
            chunk = {name: column.slice(start, chunk_rows) for name, column in columns.items()}
            handle.write(tfrecord.tfrecord_bytes(tfrecord.serialize_examples(chunk)))

    write_whole(path, write)  # never leaves a truncated file (locally, a full disk is a named error)
    owner, flat = incidences_of(rows.user_offsets, keep)
    return WrittenFile(
        FileCounts(
            written,
            truncated=len(rows.steps) - len(keep),
            padding=int((max_batch_size - written).sum()) if max_batch_size is not None else 0,
        ),
        user_hashes=rows.users[flat],
        user_steps=step[owner],
        record_keys=rows.record_keys[keep],
    )


def write_schema(output: str, schema: BatchSchema) -> None:
    storage.write_text(storage.join(output, SCHEMA_FILE), json.dumps(schema.to_json(), indent=2, sort_keys=True) + "\n")


def read_schema(output: str) -> BatchSchema:
    """The schema of a `madp batch` OUTPUT, checked (`BatchSchema.from_json`)."""
    path = storage.join(output, SCHEMA_FILE)
    try:
        data = json.loads(storage.read_text(path))
    except ValueError as error:
        raise InputError(f"{path} is not JSON ({error}); re-run madp batch") from None
    return BatchSchema.from_json(data, path)
