"""Batch materialization shared by both engines: options, inputs, the samplers on one partition
(local engine), TFRecord files and the report.

Flow: selected ids + copies (a `madp bound` output) joined with the records (users, content) ->
units (one per copy) -> sampled (unit, step) rows -> per step: order, truncate, pad -> TFRecords.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import posixpath
import time
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from madp import records as rec
from madp import sampling, storage, tfrecord
from madp.hashing import hash_ids, id_words, siphash24
from madp.progress import Progress
from madp.randomness import DETERMINISTIC, SecretKey
from madp.selection import REJECTED_DIR, REPORT_FILE, handle_rejects, read_manifest, selection_files, write_report

log = logging.getLogger("madp.batch")
SAMPLERS = ("minsep", "minsep-greedy", "users")
USER_FEATURE = "user"  # users sampler: the row's user (64-bit hash), for per-user clipping
SCHEMA_FILE = "schema.json"
RESERVED_FEATURES = ("step", "id", "weight")
PADDING_ID = -1  # the id of padding rows ("" for string ids); no selected record may have it
RECORD_STREAM, USER_STREAM, USER_SAMPLING_STREAM = 7, 8, 9  # unit keys (keyed), user identity, user sampling (keyed)
# The encoder indexes every byte it places (16 bytes of indices per byte), so rows are encoded in
# chunks of about this many bytes: 65,536 rows of 16 floats, or 512 rows of 2,048 floats.
_ENCODE_BYTES = 1 << 23


@dataclasses.dataclass(frozen=True)
class BatchOptions:
    steps: int
    batch_size: float
    sampler: str = "minsep"
    min_sep: int = 1
    warm_up: int | None = None
    max_batch_size: int | None = None
    find_max_min_sep: bool = False
    seed: int | None = None  # None: a fresh secret sampling key; an int reproduces (not private)
    columns: rec.Columns = rec.Columns()
    content_columns: tuple[str, ...] | None = None
    on_invalid: str = "error"
    output_shards: int = 1

    if TYPE_CHECKING:  # set per instance by __post_init__; no field, so never in a report or a repr
        key: ClassVar[SecretKey]

    def __post_init__(self) -> None:
        checks = [
            (self.sampler in SAMPLERS, f"--sampler must be one of {SAMPLERS}"),
            (self.steps >= 1, "--steps must be at least 1"),
            (self.batch_size > 0, "--batch-size must be positive"),
            (self.min_sep >= 1, "--min-sep must be at least 1 (1 is plain Poisson sampling)"),
            (self.warm_up is None or self.warm_up >= 0, "--warm-up must be at least 0"),
            (self.max_batch_size is None or self.max_batch_size >= 1, "--max-batch-size must be at least 1"),
            (self.output_shards >= 1, "--output-shards must be at least 1"),
            (self.on_invalid in ("error", "skip"), "--on-invalid must be 'error' or 'skip'"),
            (
                self.sampler == "minsep-greedy" or not self.find_max_min_sep,
                "--find-max-min-sep applies to --sampler minsep-greedy",
            ),
            (
                self.sampler != "users" or self.min_sep == 1,
                "--sampler users is plain Poisson sampling over users: --min-sep must be 1",
            ),
            (
                self.sampler != "minsep-greedy" or float(self.batch_size).is_integer(),
                "--batch-size must be an integer for --sampler minsep-greedy (batches have exactly B records)",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise rec.InputError(message)
        # Drawn once per run (by the driver: Beam workers get it with the pipeline), never reported.
        object.__setattr__(self, "key", SecretKey.for_run(self.seed, "batch sampling", "--seed"))

    @property
    def sampling(self) -> str:
        """What the batches' privacy rests on: a secret key, a fixed seed, or (greedy) nothing secret."""
        return DETERMINISTIC if self.sampler == "minsep-greedy" else self.key.status

    @property
    def warm_up_steps(self) -> int:
        """Exclusion looks back b-1 steps at i.i.d. samples, so batch sizes are exactly stationary after b-1."""
        if self.sampler != "minsep":
            return 0
        return self.min_sep - 1 if self.warm_up is None else self.warm_up


# --- inputs -------------------------------------------------------------------------------------


def bound_record(selected: str) -> dict:
    """What the batches are made from, for the accountant: the bound's contribution bound, its largest
    user contribution, users and parameters, and its selection files (names, sizes, SHA-256).
    Training accounts with this record, so a later re-run of `madp bound` cannot change it."""
    bound = json.loads(storage.read_text(storage.join(selected, REPORT_FILE)))
    return {
        "contribution_bound": bound["contribution_bound"],
        "max_user_contribution": bound["max_user_contribution"],
        "input_users": bound["input_users"],
        "parameters": bound["parameters"],
        "selection_files": bound["selection_files"],
    }


def read_selection_file(path: str) -> tuple[pa.Array, np.ndarray]:
    table = storage.read_parquet(path)
    if not {"id", "copies"} <= set(table.column_names):
        raise rec.InputError(f"{path}: a selection needs columns id and copies (found {table.column_names})")
    ids, copies = table.column("id").combine_chunks(), table.column("copies").combine_chunks()
    if (
        ids.null_count
        or copies.null_count
        or not pa.types.is_integer(copies.type)
        or (len(copies) and pc.min(copies).as_py() < 1)
    ):
        raise rec.InputError(f"{path}: ids must be present and copies integers >= 1")
    if pa.types.is_integer(ids.type):
        ids = ids.cast(pa.int64())
    return ids, copies.to_numpy(zero_copy_only=False).astype(np.int64)


def join_selection(
    chunk: rec.RecordChunk, ids: pa.Array, copies: np.ndarray, data: str
) -> tuple[rec.RecordChunk, np.ndarray]:
    """The selected records of `chunk` (in selection order) and their copies; every selected id must be there."""
    if len(ids) and len(chunk) and ids.type != chunk.ids.type:
        raise rec.InputError(
            f"selected ids are {ids.type} but the ids of {data} are {chunk.ids.type}: "
            f"was SELECTED bounded from this data with the same --id-column?"
        )
    if rec.duplicate_id_mask(ids).any():
        raise rec.InputError("a selected id is listed twice in SELECTED/selected/")
    reserved = pa.scalar(PADDING_ID if pa.types.is_integer(ids.type) else "", ids.type) if len(ids) else None
    if reserved is not None and pc.any(pc.equal(ids, reserved)).as_py():
        raise rec.InputError(
            f"selected record id {reserved.as_py()!r} is the id of padding rows in batches: give that record another id"
        )
    position = pc.index_in(ids, value_set=chunk.ids) if len(chunk) else pa.nulls(len(ids), pa.int32())
    missing = position.is_null().to_numpy(zero_copy_only=False)
    if missing.any():
        shown = ", ".join(repr(v) for v in ids.filter(pa.array(missing))[:10].to_pylist())
        raise rec.InputError(
            f"{int(missing.sum())} selected ids are not valid records of {data} (e.g. {shown}): "
            f"was SELECTED bounded from this data?"
        )
    index = position.to_numpy(zero_copy_only=False).astype(np.int64)
    mask = np.zeros(len(chunk), dtype=bool)
    mask[index] = True
    selected = rec.take(chunk, mask)  # in chunk order; `copies` follows it
    order = np.argsort(index, kind="stable")
    return selected, copies[order]


def content_problems(content: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """(reason, column) per row where a content value cannot be trained on ("" where all can): a
    null (the value, or one inside its list), or a NaN or infinite float (a NaN model)."""
    reason = np.full(len(content), "", dtype=object)
    where = np.full(len(content), "", dtype=object)
    for name in content.column_names:
        column = content.column(name).combine_chunks()
        values = pc.list_flatten(column) if _is_list(column.type) else column
        null = column.is_null().to_numpy(zero_copy_only=False)
        if values.null_count:
            null |= _rows_of_values(column, values.is_null().to_numpy(zero_copy_only=False))
        bad = [(null, rec.NULL_CONTENT)]
        if pa.types.is_floating(values.type) and len(values):
            finite = pc.fill_null(pc.is_finite(values), True).to_numpy(zero_copy_only=False)
            bad.append((_rows_of_values(column, ~finite), rec.NON_FINITE_CONTENT))
        for flags, why in bad:
            new = flags & (reason == "")
            reason[new], where[new] = why, name
    return reason, where


def _rows_of_values(column: pa.Array, flags: np.ndarray) -> np.ndarray:
    """Rows of `column` with a flagged value (its values flattened where it holds lists)."""
    if not _is_list(column.type):
        return flags
    found = np.zeros(len(column), dtype=bool)
    found[pc.list_parent_indices(column).to_numpy()[flags]] = True
    return found


def skip_invalid_content(
    chunk: rec.RecordChunk, copies: np.ndarray, rejects: rec.Rejects
) -> tuple[rec.RecordChunk, np.ndarray]:
    """`--on-invalid skip`: move the selected records with `content_problems` to `rejects` (dropping
    a selected record only lowers its users' contributions, so the bound still holds)."""
    reason, where = content_problems(chunk.content)
    bad = reason != ""
    for row in np.flatnonzero(bad).tolist():
        users = chunk.users[int(chunk.offsets[row]) : int(chunk.offsets[row + 1])].to_pylist()
        record = {"id": chunk.ids[row].as_py(), "users": users, "column": where[row]}
        rejects.add(*chunk.source(row), reason[row], record)
    return (rec.take(chunk, ~bad), copies[~bad]) if bad.any() else (chunk, copies)


def check_content(content: pa.Table, ids: pa.Array) -> dict[str, dict]:
    """Feature description of each content column; a null or non-finite value in a selected record is an error."""
    for name in content.column_names:
        if name in RESERVED_FEATURES:
            raise rec.InputError(
                f"content column {name!r} has the name of a batch feature {RESERVED_FEATURES}; "
                f"choose the columns with --content-columns"
            )
    reason, where = content_problems(content)
    if (reason != "").any():
        row = int(np.flatnonzero(reason != "")[0])
        problem = "is null" if reason[row] == rec.NULL_CONTENT else "holds a NaN or infinite value"
        raise rec.InputError(
            f"content column {where[row]!r} {problem} for selected record {ids[row].as_py()!r}; fix the "
            f"record, leave the column out with --content-columns, or pass --on-invalid skip"
        )
    described = {}
    for name in content.column_names:
        column = content.column(name).combine_chunks()
        values = pc.list_flatten(column) if _is_list(column.type) else column
        try:
            kind = tfrecord.feature_kind(values.type)
        except ValueError as error:
            raise rec.InputError(f"content column {name!r}: {error}; leave it out with --content-columns") from error
        if pa.types.is_fixed_size_list(column.type):
            shape = [column.type.list_size]
        elif _is_list(column.type):
            lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
            shape = [int(lengths[0])] if len(lengths) and (lengths == lengths[0]).all() else [None]
        else:
            shape = []
        described[name] = {"dtype": kind, "shape": shape}
    return described


def _is_list(value_type: pa.DataType) -> bool:
    return pa.types.is_list(value_type) or pa.types.is_large_list(value_type) or pa.types.is_fixed_size_list(value_type)


def schema(id_type: pa.DataType, content: dict[str, dict], options: BatchOptions) -> dict:
    features = {
        "step": {"dtype": tfrecord.INT64, "shape": []},
        "id": {"dtype": tfrecord.feature_kind(id_type), "shape": []},
        "weight": {"dtype": tfrecord.FLOAT, "shape": [], "note": "1.0 real record, 0.0 padding"},
        **content,
    }
    return {
        "features": features,
        "steps": options.steps,
        "max_batch_size": options.max_batch_size,
        "rows_in_step_order": True,
    }


# --- units and users ----------------------------------------------------------------------------


def record_hashes(ids: pa.Array, key: SecretKey) -> np.ndarray:
    """Each record's 64-bit sampling key: a keyed PRF of its id, unpredictable without `key`."""
    return siphash24(key.subkey(RECORD_STREAM), id_words(ids)) if len(ids) else np.zeros(0, np.uint64)


def user_hashes(users: pa.Array) -> np.ndarray:
    """64-bit user identity; a collision would only merge two users' exclusions (never fewer)."""
    return hash_ids(users, 0, purpose=USER_STREAM) if len(users) else np.zeros(0, np.uint64)


def incidences_of(offsets: np.ndarray, records: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(position in `records`, flat incidence index) of every user of each listed record."""
    return sampling.expand_ranges(offsets[records], offsets[records + 1] - offsets[records])


# --- batch files --------------------------------------------------------------------------------


def file_of_step(steps: np.ndarray, total_steps: int, files: int) -> np.ndarray:
    """Contiguous step ranges per file, so that file names sort in step order."""
    return (steps * files) // total_steps


def step_range(file: int, total_steps: int, files: int) -> range:
    return range(-(-file * total_steps // files), -(-(file + 1) * total_steps // files))


def batch_file_path(output: str, file: int, files: int) -> str:
    return storage.join(output, f"batches-{file:05d}-of-{files:05d}.tfrecord")


def batch_files(output: str) -> list[str]:
    """The batch files of a finished `madp batch` output, exactly those its report lists (they sit beside
    the schema, the report and rejects, so only files named like batch files must be listed)."""
    return read_manifest(
        output,
        "batch",
        "",
        "files",
        lambda name: posixpath.basename(name).startswith("batches-") and name.endswith(".tfrecord"),
    )


def _padding(value_type: pa.DataType, shape: list, rows: int) -> pa.Array:
    """`rows` zero values of a content column: 0, 0.0 or empty string, or a list of `shape` of them
    (empty when the length varies)."""
    if _is_list(value_type):
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


def content_shapes(described: dict[str, dict]) -> dict[str, list]:
    return {name: feature["shape"] for name, feature in described.items()}


@dataclasses.dataclass
class FileRows:
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


def write_batch_file(
    path: str, rows: FileRows, steps: range, max_batch_size: int | None, shapes: dict[str, list]
) -> dict:
    """Order each step's rows by counter-based priority, keep at most B_max, pad to B_max, write.

    Returns per-step real row counts and the written rows' (user, step) and record keys for stats.
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
                name: _padding(rows.content.schema.field(name).type, shapes[name], len(pad_steps))
                for name in rows.content.column_names
            }
        )
        # Padding rows go after the real rows of their step.
        order = np.argsort(np.concatenate([step, pad_steps]), kind="stable")
        columns = {name: pa.concat_arrays([columns[name], padding[name]]).take(pa.array(order)) for name in columns}
    rows_written = len(columns["step"])
    row_bytes = sum(column.nbytes for column in columns.values()) / max(rows_written, 1)
    chunk_rows = max(1, int(_ENCODE_BYTES // max(row_bytes, 1)))
    with storage.open_output(path) as handle:
        for start in range(0, rows_written, chunk_rows):
            chunk = {name: column.slice(start, chunk_rows) for name, column in columns.items()}
            handle.write(tfrecord.tfrecord_bytes(tfrecord.serialize_examples(chunk)))
    owner, flat = incidences_of(rows.user_offsets, keep)
    return {
        "written": written,
        "truncated": len(rows.steps) - len(keep),
        "padding": int((max_batch_size - written).sum()) if max_batch_size is not None else 0,
        "user_hashes": rows.users[flat],
        "user_steps": step[owner],
        "record_keys": rows.record_keys[keep],
    }


# --- statistics ---------------------------------------------------------------------------------


def participation_stats(user_hashes_: np.ndarray, steps: np.ndarray) -> dict:
    """Per-user participations of written rows; exact when all of a user's rows are passed together."""
    if len(steps) == 0:
        return {
            "users": 0,
            "max_participations": 0,
            "max_rows": 0,
            "min_gap": None,
            "user_rows_sharing_a_step": 0,
            "gap_histogram": {},
        }
    order = np.lexsort((steps, user_hashes_))
    user, step = user_hashes_[order], steps[order]
    new_user = np.concatenate([[True], user[1:] != user[:-1]])
    new_pair = new_user | np.concatenate([[True], step[1:] != step[:-1]])
    user_index = np.cumsum(new_user) - 1
    participations = np.bincount(user_index[new_pair])
    distinct_user, distinct_step = user[new_pair], step[new_pair]
    same = distinct_user[1:] == distinct_user[:-1]
    gaps = (distinct_step[1:] - distinct_step[:-1])[same]
    return {
        "users": int(new_user.sum()),
        "max_participations": int(participations.max()),
        "max_rows": int(np.bincount(user_index).max()),
        "min_gap": int(gaps.min()) if len(gaps) else None,
        "user_rows_sharing_a_step": int((~new_pair).sum()),
        "gap_histogram": value_counts(gaps),
    }


def value_counts(values: np.ndarray) -> dict[str, int]:
    """{value: count} with string keys (JSON objects), for histograms that merge by summing."""
    found, counts = np.unique(np.asarray(values, dtype=np.int64), return_counts=True)
    return {str(int(v)): int(c) for v, c in zip(found, counts)}


def merge_counts(histograms: list[dict[str, int]]) -> dict[str, int]:
    merged: dict[str, int] = {}
    for histogram in histograms:
        for value, count in histogram.items():
            merged[value] = merged.get(value, 0) + count
    return dict(sorted(merged.items(), key=lambda item: int(item[0])))


def merge_participation_stats(parts: list[dict]) -> dict:
    gaps = [p["min_gap"] for p in parts if p["min_gap"] is not None]
    return {
        "users": sum(p["users"] for p in parts),
        "max_participations": max((p["max_participations"] for p in parts), default=0),
        "max_rows": max((p["max_rows"] for p in parts), default=0),
        "min_gap": min(gaps) if gaps else None,
        "user_rows_sharing_a_step": sum(p["user_rows_sharing_a_step"] for p in parts),
        "gap_histogram": merge_counts([p["gap_histogram"] for p in parts]),
    }


def size_summary(sizes: np.ndarray) -> dict:
    return {
        "mean": round(float(sizes.mean()), 4) if len(sizes) else 0.0,
        "std": round(float(sizes.std()), 4) if len(sizes) else 0.0,
        "min": int(sizes.min()) if len(sizes) else 0,
        "max": int(sizes.max()) if len(sizes) else 0,
        "per_step": sizes.tolist(),
    }


def report(
    options: BatchOptions,
    engine: str,
    selected: str,
    data: str,
    output: str,
    *,
    sampled: Sampled,
    units: int,
    records: int,
    sampled_sizes: np.ndarray,
    files: list[dict],
    records_never_written: int,
    participation: dict,
    rejects: rec.Rejects,
    content_columns: list[str],
    started: float,
) -> dict:
    """The report both engines write; `sampled_sizes` (per step, before truncation) includes warm-up."""
    warm_up = options.warm_up_steps
    realized = sampled_sizes[warm_up:]
    written = np.concatenate([f["written"] for f in files])
    result = {
        "engine": engine,
        "selected": _absolute(selected),
        "data": _absolute(data),
        "sampler": options.sampler,
        "bound": bound_record(selected),
        "parameters": {
            "steps": options.steps,
            "batch_size": options.batch_size,
            "min_sep": sampled.min_sep,
            "batch_size_counts": "users" if options.sampler == "users" else "records",
            "warm_up": warm_up,
            "max_batch_size": options.max_batch_size,
            "seed": options.seed,
            "output_shards": options.output_shards,
            "on_invalid": options.on_invalid,
            "content_columns": list(content_columns),
        },
        "sampling": options.sampling,
        "sampling_probability": sampled.probability,
        "expected_batch_size": sampled.expected_batch_size,
        "steps": options.steps,
        "records": records,
        "units": units,
        "batch_sizes": size_summary(realized),
        "relative_error_to_target": round(float(realized.mean() / options.batch_size - 1.0), 6),
        "written_batch_sizes": {k: v for k, v in size_summary(written).items() if k != "per_step"},
        "warm_up_batch_sizes": sampled_sizes[:warm_up].tolist(),
        "truncated_rows": sum(f["truncated"] for f in files),
        "padding_rows": sum(f["padding"] for f in files),
        "records_never_written": records_never_written,
        "participation": participation,
        "rejected": rejects.counts(),
        "rejected_total": len(rejects),
        "files": storage.manifest(
            [batch_file_path(output, file, options.output_shards) for file in range(options.output_shards)]
        ),
        "wall_time_s": round(time.perf_counter() - started, 3),
    }
    if sampled.sampled_users is not None:
        result["users_per_step"] = size_summary(sampled.sampled_users)
        result["relative_error_to_target"] = round(float(sampled.sampled_users.mean() / options.batch_size - 1.0), 6)
    if sampled.min_sep_search is not None:
        result["min_sep_search"] = sampled.min_sep_search
        result["k"] = participation["max_participations"]
    return result


def _absolute(path: str) -> str:
    """Local paths absolute, so that later stages (the trainer) find the inputs from anywhere."""
    return path if "://" in path else os.path.abspath(path)


# --- output directory ---------------------------------------------------------------------------


def prepare_output(output: str) -> None:
    """Remove an earlier run's batch files, schema, report and rejects (and only those)."""
    for path in storage.list_files(output, recursive=False) if storage.kind(output) == "directory" else []:
        if posixpath.basename(path).startswith("batches-") and path.endswith(".tfrecord"):
            storage.remove_file(path)
    for name in (SCHEMA_FILE, REPORT_FILE):
        storage.remove_file(storage.join(output, name))
    storage.clear_directory(storage.join(output, REJECTED_DIR))


def write_schema(output: str, described: dict) -> None:
    storage.write_text(storage.join(output, SCHEMA_FILE), json.dumps(described, indent=2, sort_keys=True) + "\n")


# --- the local engine ---------------------------------------------------------------------------


@dataclasses.dataclass
class Dataset:
    """Selected records (one row each), their copies, users as CSR of hashes, and content."""

    ids: pa.Array
    copies: np.ndarray
    offsets: np.ndarray
    users: np.ndarray
    content: pa.Table
    rejects: rec.Rejects


def load(selected: str, data: str, options: BatchOptions, output: str) -> Dataset:
    from madp.local_engine import read_input

    files = rec.list_input_files(data)
    names = (
        options.content_columns
        if options.content_columns is not None
        else rec.content_columns(files[0], options.columns)
    )
    chunk, rejects, _, _ = read_input(data, options.columns, names)
    if options.on_invalid == "error":
        handle_rejects(rejects, options.on_invalid, output)
    selection = [read_selection_file(path) for path in selection_files(selected)]
    ids = pa.concat_arrays([s[0] for s in selection])
    copies = np.concatenate([s[1] for s in selection])
    chunk, copies = join_selection(chunk, ids, copies, data)
    if options.on_invalid == "skip":
        chunk, copies = skip_invalid_content(chunk, copies, rejects)
    if not len(copies):
        raise rec.InputError(f"{selected} selects no record (its bound kept none): there is nothing to batch")
    return Dataset(
        ids=chunk.ids,
        copies=copies,
        offsets=chunk.offsets,
        users=user_hashes(chunk.users),
        content=chunk.content,
        rejects=rejects,
    )


@dataclasses.dataclass
class Sampled:
    """Rows of a sampler: record index, unit key and step (warm-up included) of each."""

    record: np.ndarray
    keys: np.ndarray
    step: np.ndarray
    min_sep: int
    probability: float | None = None
    expected_batch_size: float | None = None
    min_sep_search: list | None = None
    sampled_users: np.ndarray | None = None  # users sampler: users per step, what --batch-size targets


def minsep_rows(dataset: Dataset, options: BatchOptions) -> Sampled:
    """Alg. 3 on the whole dataset, p calibrated to the target expected batch size."""
    n = len(dataset.copies)
    arity = np.diff(dataset.offsets)
    record_of_incidence = np.repeat(np.arange(n, dtype=np.int64), arity)
    neighbourhoods = sampling.neighbourhood_sizes(record_of_incidence, dataset.users, dataset.copies)
    record_of_unit, keys = sampling.unit_keys(record_hashes(dataset.ids, options.key), dataset.copies)
    histogram = sampling.size_histogram(neighbourhoods[record_of_unit])
    probability = sampling.calibrate_probability(options.batch_size, *histogram, options.min_sep)
    total = options.steps + options.warm_up_steps
    check_fits(probability * len(keys) * total, options)
    unit, step = sampling.sampled_steps(keys, probability, total)
    record = record_of_unit[unit]
    owner, flat = incidences_of(dataset.offsets, record)
    blocked = sampling.blocked_user_steps(dataset.users[flat], step[owner], options.min_sep)
    survive = ~sampling.excluded_samples(owner, blocked, len(unit))
    return Sampled(
        record[survive],
        keys[unit[survive]],
        step[survive],
        options.min_sep,
        probability,
        sampling.expected_batch_size(probability, *histogram, options.min_sep),
    )


# Bytes per sampled row in the local engine at its peak (unit, step, record, keys, incidences, sort copies).
BYTES_PER_SAMPLE = 200


def check_fits(expected_rows: float, options: BatchOptions) -> None:
    """Refuse, before allocating, a sampling whose rows cannot fit in this machine's memory."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if expected_rows * BYTES_PER_SAMPLE > memory / 2:
        raise rec.InputError(
            f"--steps {options.steps} with --batch-size {options.batch_size:g} samples about "
            f"{expected_rows:.3g} rows, about {expected_rows * BYTES_PER_SAMPLE / 2**30:.0f} GiB "
            f"in memory, more than half of this machine's {memory / 2**30:.0f} GiB: use fewer steps "
            f"or a smaller batch size, or --runner with a Beam cluster"
        )


def greedy_rows(dataset: Dataset, options: BatchOptions) -> Sampled:
    """Alg. 4; with --find-max-min-sep, the largest b before the first failure, trying b = 1, 2, ..."""
    n, batch = len(dataset.copies), int(options.batch_size)
    check_fits(float(options.steps) * batch, options)
    if batch > n:
        raise rec.InputError(
            f"--batch-size {batch} is larger than the {n} selected records: a batch cannot hold a record twice"
        )
    arity = np.diff(dataset.offsets)
    record_of_incidence = np.repeat(np.arange(n, dtype=np.int64), arity)
    _, user_codes = np.unique(dataset.users, return_inverse=True)
    tried: list[dict] = []

    def attempt(min_sep: int):
        chosen, filled = sampling.greedy_minsep(
            record_of_incidence, user_codes.astype(np.int64), n, options.steps, batch, min_sep
        )
        tried.append({"min_sep": min_sep, "feasible": chosen is not None})
        if chosen is None and (not options.find_max_min_sep or min_sep == 1):
            raise rec.InputError(
                f"no solution for --steps {options.steps} --batch-size {batch} --min-sep {min_sep}: "
                f"batch {filled} cannot be filled, a full pass over the {n} selected records adds "
                f"none to it; lower --min-sep or --batch-size"
                + ("" if options.find_max_min_sep else ", or try --find-max-min-sep")
            )
        return chosen

    if not options.find_max_min_sep:
        chosen, min_sep = attempt(options.min_sep), options.min_sep
    else:
        chosen, min_sep = attempt(1), 1
        while min_sep < options.steps:
            candidate = attempt(min_sep + 1)
            if candidate is None:
                break
            chosen, min_sep = candidate, min_sep + 1
    steps = np.repeat(np.arange(options.steps, dtype=np.int64), batch)
    # A record's copies are interchangeable here; the greedy may use a record any number of times.
    keys = sampling.splitmix64(record_hashes(dataset.ids, options.key)[chosen] ^ steps.astype(np.uint64))
    return Sampled(chosen, keys, steps, min_sep, min_sep_search=tried)


def user_rows(dataset: Dataset, options: BatchOptions) -> Sampled:
    """User-level Poisson sampling (ELS paper's ULS) for single-attribution records: each step
    samples every user with probability q = B / users (geometric gaps keyed by (seed, user)),
    and a sampled user brings all its units."""
    distinct, user_of_record = np.unique(single_users(dataset), return_inverse=True)
    if not 0 < options.batch_size <= len(distinct):
        raise rec.InputError(f"--batch-size (users per step) must be in (0, {len(distinct)}] for --sampler users")
    probability = options.batch_size / len(distinct)
    check_fits(probability * float(dataset.copies.sum()) * options.steps, options)
    user_keys = siphash24(options.key.subkey(USER_SAMPLING_STREAM), distinct)
    user, step = sampling.sampled_steps(user_keys, probability, options.steps)
    record_of_unit, keys = sampling.unit_keys(record_hashes(dataset.ids, options.key), dataset.copies)
    by_user = np.argsort(user_of_record[record_of_unit], kind="stable")
    units_per_user = np.bincount(user_of_record[record_of_unit], minlength=len(distinct))
    first_unit = np.concatenate([[0], np.cumsum(units_per_user)[:-1]])
    owner, position = sampling.expand_ranges(first_unit[user], units_per_user[user])
    unit = by_user[position]
    return Sampled(
        record_of_unit[unit],
        keys[unit],
        step[owner],
        1,
        probability,
        float(options.batch_size),
        sampled_users=np.bincount(step, minlength=options.steps),
    )


def single_users(dataset: Dataset) -> np.ndarray:
    """The user of each record, which must have exactly one (user-level sampling)."""
    arity = np.diff(dataset.offsets)
    if (arity != 1).any():
        first = int(np.flatnonzero(arity != 1)[0])
        raise rec.InputError(
            f"--sampler users needs single-attribution records (one user each); record "
            f"{dataset.ids[first].as_py()!r} has {int(arity[first])}"
        )
    return dataset.users


def run_local(selected: str, data: str, output: str, options: BatchOptions, engine: str = "local") -> dict:
    """`madp batch --runner local`: load, sample, write TFRecords, schema and report."""
    started = time.perf_counter()
    dataset = load(selected, data, options, output)
    if options.sampler == "users":
        if USER_FEATURE in dataset.content.column_names:
            raise rec.InputError(
                f"--sampler users adds a feature {USER_FEATURE!r}: leave the content column "
                f"{USER_FEATURE!r} out with --content-columns"
            )
        dataset.content = dataset.content.append_column(USER_FEATURE, pa.array(single_users(dataset).view(np.int64)))
    described = check_content(dataset.content, dataset.ids)
    samplers = {"minsep": minsep_rows, "minsep-greedy": greedy_rows, "users": user_rows}
    sampled = samplers[options.sampler](dataset, options)
    log.info("sampled %d rows in %.1f s", len(sampled.record), time.perf_counter() - started)
    warm_up = options.warm_up_steps
    sampled_sizes = np.bincount(sampled.step, minlength=options.steps + warm_up)
    real = sampled.step >= warm_up
    record, keys, step = sampled.record[real], sampled.keys[real], sampled.step[real] - warm_up

    prepare_output(output)
    handle_rejects(dataset.rejects, options.on_invalid, output)
    record_keys = record_hashes(dataset.ids, options.key)
    files = options.output_shards
    file_of_row = file_of_step(step, options.steps, files)
    results = []
    progress = Progress(log, "writing batch files", files, "files")
    for file in range(files):
        mine = np.flatnonzero(file_of_row == file)
        rows = file_rows(
            dataset.ids,
            dataset.content,
            dataset.offsets,
            dataset.users,
            record_keys,
            record[mine],
            keys[mine],
            step[mine],
        )
        results.append(
            write_batch_file(
                batch_file_path(output, file, files),
                rows,
                step_range(file, options.steps, files),
                options.max_batch_size,
                content_shapes(described),
            )
        )
        progress.update(file + 1, f", {len(mine)} rows in {batch_file_path(output, file, files)}")
    write_schema(output, schema(dataset.ids.type, described, options))
    written_records = np.unique(np.concatenate([r["record_keys"] for r in results]))
    result = report(
        options,
        engine,
        selected,
        data,
        output,
        sampled=sampled,
        units=int(dataset.copies.sum()),
        records=len(dataset.copies),
        sampled_sizes=sampled_sizes,
        files=results,
        records_never_written=len(dataset.copies) - len(written_records),
        participation=participation_stats(
            np.concatenate([r["user_hashes"] for r in results]), np.concatenate([r["user_steps"] for r in results])
        ),
        rejects=dataset.rejects,
        content_columns=dataset.content.column_names,
        started=started,
    )
    write_report(output, result)
    return result
