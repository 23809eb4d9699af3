"""Batch materialization shared by both engines: options, and the inputs (the selection joined with
the records, content checks, the keys of units and users). The files are `batch_files`, the report
`batch_report`, the in-memory engine `batch_local`, the Beam one `beam_pipelines.batch`.

Flow: selected ids + copies (a `madp bound` output) joined with the records (users, content) ->
units (one per copy) -> sampled (unit, step) rows -> per step: order, truncate, pad -> TFRecords.
"""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from madp.core import records as rec
from madp.core import storage, tfrecord
from madp.core.batch_files import PADDING_ID, RESERVED_FEATURES, is_list
from madp.core.errors import InputError
from madp.core.hashing import hash_ids, id_words, siphash24
from madp.core.randomness import DETERMINISTIC, SecretKey
from madp.core.selection import REPORT_FILE

SAMPLERS = ("minsep", "minsep-greedy", "users")
RECORD_STREAM, USER_STREAM, USER_SAMPLING_STREAM = 7, 8, 9  # unit keys (keyed), user identity, user sampling (keyed)


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
                raise InputError(message)
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

    @property
    def sampled_steps(self) -> int:
        """Steps sampled: the warm-up's, then the training's."""
        return self.warm_up_steps + self.steps


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
    return selection_arrays(storage.read_parquet(path), path)


def selection_arrays(table: pa.Table, where: str) -> tuple[pa.Array, np.ndarray]:
    """A selection table's ids (integers as int64) and copies, checked: `where` names it in errors."""
    if not {"id", "copies"} <= set(table.column_names):
        raise InputError(f"{where}: a selection needs columns id and copies (found {table.column_names})")
    ids, copies = table.column("id").combine_chunks(), table.column("copies").combine_chunks()
    if (
        ids.null_count
        or copies.null_count
        or not pa.types.is_integer(copies.type)
        or (len(copies) and pc.min(copies).as_py() < 1)
    ):
        raise InputError(f"{where}: ids must be present and copies integers >= 1")
    if pa.types.is_integer(ids.type):
        ids = ids.cast(pa.int64())
    return ids, copies.to_numpy(zero_copy_only=False).astype(np.int64)


def join_selection(
    chunk: rec.RecordChunk, ids: pa.Array, copies: np.ndarray, data: str
) -> tuple[rec.RecordChunk, np.ndarray]:
    """The selected records of `chunk` (in selection order) and their copies; every selected id must be there."""
    if len(ids) and len(chunk) and ids.type != chunk.ids.type:
        raise InputError(
            f"selected ids are {ids.type} but the ids of {data} are {chunk.ids.type}: "
            f"was SELECTED bounded from this data with the same --id-column?"
        )
    if rec.duplicate_id_mask(ids).any():
        raise InputError("a selected id is listed twice in SELECTED/selected/")
    reserved = pa.scalar(PADDING_ID if pa.types.is_integer(ids.type) else "", ids.type) if len(ids) else None
    if reserved is not None and pc.any(pc.equal(ids, reserved)).as_py():
        raise InputError(
            f"selected record id {reserved.as_py()!r} is the id of padding rows in batches: give that record another id"
        )
    position = pc.index_in(ids, value_set=chunk.ids) if len(chunk) else pa.nulls(len(ids), pa.int32())
    missing = position.is_null().to_numpy(zero_copy_only=False)
    if missing.any():
        shown = ", ".join(repr(v) for v in ids.filter(pa.array(missing))[:10].to_pylist())
        raise InputError(
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
        values = pc.list_flatten(column) if is_list(column.type) else column
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
    if not is_list(column.type):
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
            raise InputError(
                f"content column {name!r} has the name of a batch feature {RESERVED_FEATURES}; "
                f"choose the columns with --content-columns"
            )
    reason, where = content_problems(content)
    if (reason != "").any():
        row = int(np.flatnonzero(reason != "")[0])
        problem = "is null" if reason[row] == rec.NULL_CONTENT else "holds a NaN or infinite value"
        raise InputError(
            f"content column {where[row]!r} {problem} for selected record {ids[row].as_py()!r}; fix the "
            f"record, leave the column out with --content-columns, or pass --on-invalid skip"
        )
    described = {}
    for name in content.column_names:
        column = content.column(name).combine_chunks()
        values = pc.list_flatten(column) if is_list(column.type) else column
        try:
            kind = tfrecord.feature_kind(values.type)
        except ValueError as error:
            raise InputError(f"content column {name!r}: {error}; leave it out with --content-columns") from error
        if pa.types.is_fixed_size_list(column.type):
            shape = [column.type.list_size]
        elif is_list(column.type):
            lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
            shape = [int(lengths[0])] if len(lengths) and (lengths == lengths[0]).all() else [None]
        else:
            shape = []
        described[name] = {"dtype": kind, "shape": shape}
    return described


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
