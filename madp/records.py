"""Reading and validating multi-user records: one input file becomes one columnar chunk.

A record is a row with an id (integer or string, unique) and a non-empty list of user
ids (integers or strings). Both engines call `read_file` and `merge_chunks`, so they
accept and reject exactly the same rows.
"""

from __future__ import annotations

import codecs
import dataclasses
import gzip
import io
import json
import logging
import posixpath

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pa_json

from madp import storage
from madp.errors import InputError

log = logging.getLogger("madp")

INPUT_SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")

# Why a row is rejected, in the order checks run.
MISSING_ID = "missing_id"
BAD_ID_TYPE = "bad_id_type"
MISSING_USERS = "missing_users"
EMPTY_USERS = "empty_users"
NULL_USER = "null_user"
NON_SCALAR_USER = "non_scalar_user"
BAD_USER_TYPE = "bad_user_type"
BAD_WEIGHT = "bad_weight"
INVALID_JSON = "invalid_json"
DUPLICATE_ID = "duplicate_id"
NULL_CONTENT = "null_content"  # batching: a selected record's content value is null
NON_FINITE_CONTENT = "non_finite_content"  # batching: ... or a NaN or infinite float
REJECT_REASONS = (
    INVALID_JSON,
    MISSING_ID,
    BAD_ID_TYPE,
    MISSING_USERS,
    EMPTY_USERS,
    NULL_USER,
    NON_SCALAR_USER,
    BAD_USER_TYPE,
    BAD_WEIGHT,
    DUPLICATE_ID,
    NULL_CONTENT,
    NON_FINITE_CONTENT,
)

_ROW_KEY_BITS = 40  # record key = file index << 40 | row: unique without any global pass


@dataclasses.dataclass(frozen=True)
class Columns:
    id: str = "id"
    users: str = "users"
    weight: str | None = None


@dataclasses.dataclass
class Rejects:
    """Rejected rows: where they are, why, and what they held (as JSON text)."""

    file: list[str] = dataclasses.field(default_factory=list)
    row: list[int] = dataclasses.field(default_factory=list)
    reason: list[str] = dataclasses.field(default_factory=list)
    record: list[str] = dataclasses.field(default_factory=list)

    def add(self, file: str, row: int, reason: str, record: object) -> None:
        self.file.append(file)
        self.row.append(int(row))
        self.reason.append(reason)
        self.record.append(json.dumps(record, default=str, sort_keys=True))

    def extend(self, other: Rejects) -> None:
        for name in ("file", "row", "reason", "record"):
            getattr(self, name).extend(getattr(other, name))

    def counts(self) -> dict[str, int]:
        return {r: self.reason.count(r) for r in REJECT_REASONS if r in self.reason}

    def __len__(self) -> int:
        return len(self.reason)

    @classmethod
    def from_jsonl(cls, text: str) -> Rejects:
        rejects = cls()
        for line in text.splitlines():
            row = json.loads(line)
            rejects.add(row["file"], row["row"], row["reason"], row["record"])
        return rejects

    def to_jsonl(self) -> str:
        rows = sorted(zip(self.file, self.row, self.reason, self.record))
        return "".join(
            json.dumps({"file": f, "row": r, "reason": why, "record": json.loads(rec)}) + "\n"
            for f, r, why, rec in rows
        )


@dataclasses.dataclass
class RecordChunk:
    """Valid records in columnar form: users as a CSR list (offsets into `users`)."""

    keys: np.ndarray  # int64, unique per record across the whole input
    ids: pa.Array  # int64 or string
    offsets: np.ndarray  # int64, len(ids) + 1
    users: pa.Array  # flat user ids, int64 or string, no repeats within a record
    weights: np.ndarray | None
    sources: dict[int, str]  # input file of each file index in `keys`
    content: pa.Table | None = None  # other columns carried along (batching), one row per record

    def __len__(self) -> int:
        return len(self.ids)

    def source(self, record: int) -> tuple[str, int]:
        """(file, row) a record was read from."""
        key = int(self.keys[record])
        return self.sources[key >> _ROW_KEY_BITS], key & ((1 << _ROW_KEY_BITS) - 1)

    @property
    def arity(self) -> np.ndarray:
        return np.diff(self.offsets)


@dataclasses.dataclass
class FileResult:
    chunk: RecordChunk
    rejects: Rejects
    rows_read: int
    repeated_users_removed: int


def list_input_files(path: str) -> list[str]:
    """The input files of a path: the file itself, or every .jsonl, .jsonl.gz or .parquet file below a
    directory (names starting with '.' or '_' skipped); other files there are named in a warning."""
    found = storage.kind(path)
    if found == "directory":
        visible = _visible_files(path)
        files = [f for f in visible if f.endswith(INPUT_SUFFIXES)]
        ignored = [f for f in visible if not f.endswith(INPUT_SUFFIXES)]
        if ignored:
            log.warning(
                "%s: %d files are not read (only %s are): %s",
                path,
                len(ignored),
                ", ".join(INPUT_SUFFIXES),
                ", ".join(ignored[:10]) + (" ..." if len(ignored) > 10 else ""),
            )
        if not files:
            raise InputError(f"{path}: directory holds no {', '.join(INPUT_SUFFIXES)} files")
        return files
    if found == "missing":
        raise InputError(f"{path}: no such file or directory")
    if not path.endswith(INPUT_SUFFIXES):
        raise InputError(f"{path}: unsupported input format (expected {', '.join(INPUT_SUFFIXES)})")
    return [path]


def _visible_files(directory: str) -> list[str]:
    return [f for f in storage.list_files(directory) if not posixpath.basename(f).startswith((".", "_"))]


def ignored_input_files(path: str) -> list[str]:
    """Files of an input directory that are not read for their suffix (e.g. .JSONL, .parq, .csv)."""
    if storage.kind(path) != "directory":
        return []
    return [f for f in _visible_files(path) if not f.endswith(INPUT_SUFFIXES)]


def jsonl_lines(path: str) -> list[bytes]:
    """The rows of a JSON Lines file: its non-blank lines, a leading UTF-8 byte order mark removed.
    Row numbers in errors and rejects count these lines from 0."""
    with storage.open_input(path) as handle:
        data = handle.read()
    if path.endswith(".gz"):
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as error:
            raise InputError(f"{path}: not a readable gzip file: {error}") from error
    if data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8) :]
    return [line for line in data.splitlines() if line.strip()]


def _arrow_json(lines: list[bytes]) -> pa.Table | None:
    """Arrow's fast JSON reader over `lines`, or None where it could disagree with one row per line.

    Arrow reads a value split over two lines, or two values on one line, as records and crashes on
    a top-level `null`; the row-by-row parse rejects such lines, so ids and content cannot shift."""
    if not all(line.lstrip().startswith(b"{") and line.rstrip().endswith(b"}") for line in lines):
        return None
    try:
        table = pa_json.read_json(io.BytesIO(b"\n".join(lines)))
    except pa.ArrowInvalid:
        return None
    return table if len(table) == len(lines) else None


def read_file(path: str, file_index: int, columns: Columns, content: tuple[str, ...] | None = None) -> FileResult:
    """Read one input file and split it into valid records and rejected rows; with `content`,
    also carry those columns of the valid records."""
    lines = None if path.endswith(".parquet") else jsonl_lines(path)  # one read for records and content
    if lines is None:
        table = _read_parquet(path, columns)
        non_conforming = None
    else:
        table, non_conforming = _read_jsonl(path, lines, columns)
    result = _validate(table, non_conforming, path, file_index, columns)
    if content is not None:
        rows = result.chunk.keys & ((1 << _ROW_KEY_BITS) - 1)
        result.chunk.content = _read_content(path, lines, content).take(pa.array(rows))
    return result


def content_columns(path: str, columns: Columns) -> tuple[str, ...]:
    """The columns of an input file other than the id, users and weight columns."""
    if path.endswith(".parquet"):
        names = storage.parquet_columns(path)
    else:
        lines = jsonl_lines(path)
        table = _arrow_json(lines)
        names = (
            table.column_names
            if table is not None
            else list(dict.fromkeys(key for obj in map(_json_object, lines) for key in obj))
        )
    return tuple(n for n in names if n not in _wanted(columns))


def _json_object(line: bytes) -> dict:
    """A line's JSON object, or {} for a line that is not one."""
    try:
        obj = json.loads(line)
    except ValueError:
        return {}
    return obj if isinstance(obj, dict) else {}


def _read_content(path: str, lines: list[bytes] | None, names: tuple[str, ...]) -> pa.Table:
    """Columns `names` of every row of a file: Parquet (`lines` None), or the JSON Lines rows `lines`
    (rows that are not JSON objects read as nulls)."""
    if lines is None:
        found = storage.parquet_columns(path)
        missing = [n for n in names if n not in found]
        if missing:
            raise InputError(f"{path}: no content column {missing} (found {found})")
        return storage.read_parquet(path, list(names))
    objects = [_json_object(line) for line in lines]
    arrays = {}
    for name in names:
        if not any(name in obj for obj in objects):
            raise InputError(f"{path}: no content column {name!r} in any row")
        try:
            arrays[name] = pa.array([obj.get(name) for obj in objects])
        except (pa.ArrowInvalid, pa.ArrowTypeError) as error:
            raise InputError(f"{path}: content column {name!r} mixes types: {error}") from error
    return pa.table(arrays) if arrays else pa.table({"_": pa.nulls(len(objects))}).drop(["_"])


def _wanted(columns: Columns) -> list[str]:
    return [c for c in (columns.id, columns.users, columns.weight) if c]


def _require_columns(path: str, found: list[str], columns: Columns) -> None:
    missing = [c for c in _wanted(columns) if c not in found]
    if missing:
        raise InputError(
            f"{path}: no column {missing} in any row (found {found}); "
            f"name the columns with --id-column, --users-column or --weight-column"
        )


def _read_parquet(path: str, columns: Columns) -> pa.Table:
    _require_columns(path, storage.parquet_columns(path), columns)
    return storage.read_parquet(path, _wanted(columns))


def _read_jsonl(
    path: str, lines: list[bytes], columns: Columns
) -> tuple[pa.Table, dict[int, tuple[str, object]] | None]:
    """Fast path through Arrow; rows Arrow cannot type are parsed one by one to name the bad row."""
    if not lines:
        return _empty_table(columns), None
    table = _arrow_json(lines)
    if table is None:
        return _parse_jsonl_rows(path, lines, columns)
    _require_columns(path, table.column_names, columns)
    if _conforming(table, columns):
        return table.select(_wanted(columns)), None
    return _parse_jsonl_rows(path, lines, columns)


def _conforming(table: pa.Table, columns: Columns) -> bool:
    id_type, users_type = table.schema.field(columns.id).type, table.schema.field(columns.users).type
    scalar = (pa.types.is_integer, pa.types.is_string, pa.types.is_large_string)
    return (
        any(f(id_type) for f in scalar)
        and pa.types.is_list(users_type)
        and any(f(users_type.value_type) for f in scalar)
        and (
            not columns.weight
            or pa.types.is_integer(table.schema.field(columns.weight).type)
            or pa.types.is_floating(table.schema.field(columns.weight).type)
        )
    )


def _empty_table(columns: Columns) -> pa.Table:
    fields = [pa.field(columns.id, pa.int64()), pa.field(columns.users, pa.list_(pa.int64()))]
    if columns.weight:
        fields.append(pa.field(columns.weight, pa.float64()))
    return pa.Table.from_pylist([], schema=pa.schema(fields))


_INT64 = (-(2**63), 2**63 - 1)


def _is_id(value: object) -> bool:
    """A string, or an integer that fits in 64 bits (JSON booleans are not integers here)."""
    return isinstance(value, str) or (
        isinstance(value, int) and not isinstance(value, bool) and _INT64[0] <= value <= _INT64[1]
    )


def _row_problem(obj: dict, columns: Columns) -> str | None:
    """Why a parsed JSON object cannot be typed as a record, or None (nulls are checked later)."""
    record_id, record_users = obj.get(columns.id), obj.get(columns.users)
    if record_id is not None and not _is_id(record_id):
        return BAD_ID_TYPE
    if record_users is not None and (
        not isinstance(record_users, list) or any(isinstance(u, (list, dict)) for u in record_users)
    ):
        return NON_SCALAR_USER
    if record_users is not None and not all(u is None or _is_id(u) for u in record_users):
        return BAD_USER_TYPE
    weight = obj.get(columns.weight) if columns.weight else None
    if weight is not None and (isinstance(weight, bool) or not isinstance(weight, (int, float))):
        return BAD_WEIGHT
    return None


def _parse_jsonl_rows(
    path: str, lines: list[bytes], columns: Columns
) -> tuple[pa.Table, dict[int, tuple[str, object]]]:
    """Row-by-row parse, one row per line: rows with wrongly typed fields are blanked and their reason kept."""
    ids: list[object] = []
    users: list[list | None] = []
    weights: list[object] = []
    problems: dict[int, tuple[str, object]] = {}
    for row, line in enumerate(lines):
        try:
            obj = json.loads(line)
        except ValueError:
            obj = None
        if not isinstance(obj, dict):
            problems[row] = (INVALID_JSON, line.decode("utf-8", "replace"))
        elif (why := _row_problem(obj, columns)) is not None:
            problems[row] = (why, obj)
        if row in problems:
            ids.append(None)
            users.append(None)
            weights.append(None)
        else:
            ids.append(obj.get(columns.id))
            users.append(obj.get(columns.users))
            weights.append(obj.get(columns.weight) if columns.weight else None)
    id_array = _unify_scalars(ids, path, "id")
    value_array = _unify_scalars([u for us in users if us for u in us], path, "user")
    arrays = {columns.id: id_array, columns.users: pa.array(users, type=pa.list_(value_array.type))}
    if columns.weight:
        arrays[columns.weight] = pa.array(weights, type=pa.float64())
    return pa.table(arrays), problems


def _unify_scalars(values: list, path: str, what: str) -> pa.Array:
    kinds = {type(v) for v in values if v is not None}
    if kinds == {int, str}:
        raise InputError(f"{path}: {what} ids mix integers and strings; use one type per column")
    kind = kinds.pop() if kinds else int
    return pa.array(values, type=pa.string() if kind is str else pa.int64())


def _cast(values: pa.Array, target: pa.DataType, path: str, what: str) -> pa.Array:
    try:
        return values.cast(target)
    except pa.ArrowInvalid as error:
        raise InputError(f"{path}: {what} do not fit {target} (64-bit signed integers): {error}") from error


def _validate(
    table: pa.Table, non_conforming: dict[int, tuple[str, object]] | None, path: str, file_index: int, columns: Columns
) -> FileResult:
    n = len(table)
    ids = table.column(columns.id).combine_chunks()
    if pa.types.is_large_string(ids.type):
        ids = _cast(ids, pa.string(), path, "ids")
    elif pa.types.is_integer(ids.type):
        ids = _cast(ids, pa.int64(), path, "ids")
    elif not pa.types.is_string(ids.type) and not pa.types.is_null(ids.type):
        raise InputError(f"{path}: id column {columns.id!r} has type {ids.type}; expected integers or strings")
    users = table.column(columns.users).combine_chunks()
    if pa.types.is_null(users.type):
        users = pa.nulls(n, pa.list_(pa.int64()))
    if not pa.types.is_list(users.type) and not pa.types.is_large_list(users.type):
        raise InputError(f"{path}: users column {columns.users!r} has type {users.type}; expected a list")
    if pa.types.is_large_string(users.type.value_type):
        users = _cast(users, pa.list_(pa.string()), path, "user ids")
    elif pa.types.is_integer(users.type.value_type) or pa.types.is_null(users.type.value_type):
        users = _cast(users, pa.list_(pa.int64()), path, "user ids")
    elif not pa.types.is_string(users.type.value_type):
        raise InputError(
            f"{path}: users column {columns.users!r} holds {users.type.value_type}; expected integer or string user ids"
        )

    reason = np.full(n, "", dtype=object)
    for row, (why, _) in (non_conforming or {}).items():
        reason[row] = why
    lengths = pc.list_value_length(users).to_numpy(zero_copy_only=False)
    user_null_in_row = np.zeros(n, dtype=bool)
    flat = pc.list_flatten(users)
    if len(flat):
        parents = pc.list_parent_indices(users).to_numpy()
        np.logical_or.at(user_null_in_row, parents[flat.is_null().to_numpy(zero_copy_only=False)], True)
    weights = None
    checks = [
        (ids.is_null().to_numpy(zero_copy_only=False), MISSING_ID),
        (users.is_null().to_numpy(zero_copy_only=False), MISSING_USERS),
        (np.nan_to_num(lengths, nan=1) == 0, EMPTY_USERS),
        (user_null_in_row, NULL_USER),
    ]
    if columns.weight:
        weights = table.column(columns.weight).combine_chunks().cast(pa.float64()).to_numpy(zero_copy_only=False)
        checks.append((~np.isfinite(weights), BAD_WEIGHT))
    for failed, why in checks:
        reason[(reason == "") & failed] = why
    valid = reason == ""

    rejects = Rejects()
    for row in np.flatnonzero(~valid).tolist():
        if non_conforming and row in non_conforming:
            record = non_conforming[row][1]
        else:
            record = {name: table.column(name)[int(row)].as_py() for name in table.column_names}
        rejects.add(path, row, reason[row], record)

    rows = np.flatnonzero(valid).astype(np.int64)
    valid_users = users.filter(pa.array(valid))
    offsets, flat_users, removed = _drop_repeated_users(valid_users)
    chunk = RecordChunk(
        keys=(np.int64(file_index) << np.int64(_ROW_KEY_BITS)) | rows,
        ids=ids.filter(pa.array(valid)),
        offsets=offsets,
        users=flat_users,
        weights=None if weights is None else weights[valid],
        sources={file_index: path},
    )
    return FileResult(chunk, rejects, n, removed)


def _drop_repeated_users(users: pa.ListArray) -> tuple[np.ndarray, pa.Array, int]:
    """Keep the first occurrence of each user within each record."""
    flat = pc.list_flatten(users)
    if len(flat) == 0:
        return np.zeros(len(users) + 1, dtype=np.int64), flat, 0
    parents = pc.list_parent_indices(users).to_numpy().astype(np.int64)
    codes = pc.dictionary_encode(flat).indices.to_numpy().astype(np.int64)
    order = np.lexsort((np.arange(len(codes)), codes, parents))
    repeat = np.zeros(len(codes), dtype=bool)
    same = (parents[order][1:] == parents[order][:-1]) & (codes[order][1:] == codes[order][:-1])
    repeat[order[1:][same]] = True
    keep = ~repeat
    counts = np.bincount(parents[keep], minlength=len(users))
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return offsets, flat.filter(pa.array(keep)), int(repeat.sum())


def merge_chunks(chunks: list[RecordChunk]) -> RecordChunk:
    """Concatenate chunks (in the given order) into one."""
    non_empty = [c for c in chunks if len(c)] or chunks[:1]
    _check_same_type([c.ids.type for c in non_empty], "record")
    _check_same_type([c.users.type for c in non_empty if len(c.users)], "user")
    sources = {index: path for c in non_empty for index, path in c.sources.items()}
    offsets = [non_empty[0].offsets[:1]]
    base = 0
    for c in non_empty:
        offsets.append(c.offsets[1:] + base)
        base += int(c.offsets[-1])
    weights = None if non_empty[0].weights is None else np.concatenate([c.weights for c in non_empty])
    content = None
    if non_empty[0].content is not None:
        try:
            content = pa.concat_tables([c.content for c in non_empty], promote_options="permissive")
        except (pa.ArrowInvalid, pa.ArrowTypeError) as error:
            raise InputError(f"content columns have different types in different input files: {error}") from error
    return RecordChunk(
        keys=np.concatenate([c.keys for c in non_empty]),
        ids=pa.concat_arrays([c.ids for c in non_empty]),
        offsets=np.concatenate(offsets),
        users=pa.concat_arrays([c.users for c in non_empty]),
        weights=weights,
        sources=sources,
        content=content,
    )


def _check_same_type(types: list[pa.DataType], what: str) -> None:
    if len(set(types)) > 1:
        raise InputError(
            f"{what} ids mix integers and strings across input files ({sorted(map(str, set(types)))}); "
            f"use one type per column"
        )


def duplicate_id_mask(ids: pa.Array) -> np.ndarray:
    """True for every record whose id occurs more than once (all occurrences: none is preferred)."""
    if len(ids) == 0:
        return np.zeros(0, dtype=bool)
    codes = pc.dictionary_encode(ids).indices.to_numpy()
    return np.bincount(codes)[codes] > 1


def take(chunk: RecordChunk, mask: np.ndarray) -> RecordChunk:
    """The records of `chunk` where `mask` is true, users and all."""
    index = np.flatnonzero(mask)
    arity = chunk.arity[index]
    offsets = np.concatenate([[0], np.cumsum(arity)]).astype(np.int64)
    flat_index = np.repeat(chunk.offsets[:-1][index], arity) + (np.arange(offsets[-1]) - np.repeat(offsets[:-1], arity))
    return RecordChunk(
        keys=chunk.keys[index],
        ids=chunk.ids.take(pa.array(index)),
        offsets=offsets,
        users=chunk.users.take(pa.array(flat_index)),
        weights=None if chunk.weights is None else chunk.weights[index],
        sources=chunk.sources,
        content=None if chunk.content is None else chunk.content.take(pa.array(index)),
    )


def reject_duplicates(chunk: RecordChunk, rejects: Rejects) -> RecordChunk:
    """Move every record with a duplicated id from `chunk` to `rejects`."""
    duplicated = duplicate_id_mask(chunk.ids)
    for i in np.flatnonzero(duplicated):
        users = chunk.users[int(chunk.offsets[i]) : int(chunk.offsets[i + 1])].to_pylist()
        rejects.add(*chunk.source(int(i)), DUPLICATE_ID, {"id": chunk.ids[int(i)].as_py(), "users": users})
    return take(chunk, ~duplicated) if duplicated.any() else chunk
