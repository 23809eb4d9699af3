"""The row rules that make a row a record or a reject, by reason (docs/how-to/your-data.md): a JSON object's values
typed as a record's (`row_problem`), then the rows of a table read from any format
(`validate_rows`): ids, users (one list column, or the union of --users-columns), weights, user ids
as e-mail addresses, repeated users dropped, and string user ids that may name one person twice
(`user_ids.find_suspects`). `record_reading` reads each format into such a table; the verifier
implements the rules on its own (verify.py)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from madp.core import user_ids
from madp.core.errors import InputError
from madp.core.records import (
    BAD_ADDRESS,
    BAD_ID_TYPE,
    BAD_USER_TYPE,
    BAD_WEIGHT,
    EMPTY_USERS,
    MISSING_ID,
    MISSING_USERS,
    NON_SCALAR_USER,
    NULL_USER,
    ROW_KEY_BITS,
    Columns,
    FileResult,
    ReadFacts,
    RecordChunk,
    Rejects,
)

_INT64 = (-(2**63), 2**63 - 1)


def _is_id(value: object) -> bool:
    """A string, or an integer that fits in 64 bits (JSON booleans are not integers here)."""
    return isinstance(value, str) or (
        isinstance(value, int) and not isinstance(value, bool) and _INT64[0] <= value <= _INT64[1]
    )


def row_problem(obj: dict, columns: Columns) -> str | None:
    """Why a parsed JSON object cannot be typed as a record, or None (nulls are checked later)."""
    record_id = obj.get(columns.id)
    if record_id is not None and not _is_id(record_id):
        return BAD_ID_TYPE
    for name in columns.user_sources:
        if (why := _users_value_problem(obj.get(name), scalar_allowed=bool(columns.users_columns))) is not None:
            return why
    weight = obj.get(columns.weight) if columns.weight else None
    if weight is not None and (isinstance(weight, bool) or not isinstance(weight, (int, float))):
        return BAD_WEIGHT
    return None


def _users_value_problem(value: object, scalar_allowed: bool) -> str | None:
    """Why a users column's value is no list of user ids (nor, with `scalar_allowed`, one user id), or
    None; nulls are judged later (a null list is missing users, a null in a list a null user)."""
    if value is None:
        return None
    if isinstance(value, list):
        if any(isinstance(u, (list, dict)) for u in value):
            return NON_SCALAR_USER
        return None if all(u is None or _is_id(u) for u in value) else BAD_USER_TYPE
    if not scalar_allowed or isinstance(value, dict):
        return NON_SCALAR_USER
    return None if _is_id(value) else BAD_USER_TYPE


def is_scalar_type(kind: pa.DataType) -> bool:
    return pa.types.is_integer(kind) or pa.types.is_string(kind) or pa.types.is_large_string(kind)


def mixed_ids(path: str, what: str) -> InputError:
    return InputError(f"{path}: {what} ids mix integers and strings; use one type per column")


def _cast(values: pa.Array, target: pa.DataType, path: str, what: str) -> pa.Array:
    try:
        return values.cast(target)
    except pa.ArrowInvalid as error:
        raise InputError(f"{path}: {what} do not fit {target} (64-bit signed integers): {error}") from error


def validate_rows(
    table: pa.Table,
    non_conforming: dict[int, tuple[str, object]] | None,
    path: str,
    file_index: int,
    columns: Columns,
    first_row: int,
    seen: frozenset[str] | None,
) -> FileResult:
    """Valid records and rejected rows of `table` (rows numbered from `first_row`), and their facts
    (`seen`: the columns some row has, None when no row is an object; a Parquet table's own columns)."""
    n = len(table)
    ids = _typed_ids(table.column(columns.id).combine_chunks(), columns.id, path)
    users = _users_union(table, columns, path) if columns.users_columns else _users_list(table, columns.users, path)
    flat = pc.list_flatten(users)
    weights = _weights(table, columns.weight) if columns.weight else None
    reason = _reasons(ids, users, flat, weights, non_conforming)
    valid_users = _addressed_users(users, reason, columns.user_ids)
    valid = reason == ""
    rejects = _rejects(table, reason, non_conforming, path, first_row)
    rows = first_row + np.flatnonzero(valid).astype(np.int64)
    offsets, flat_users, removed = _drop_repeated_users(valid_users)
    chunk = RecordChunk(
        keys=(np.int64(file_index) << np.int64(ROW_KEY_BITS)) | rows,
        ids=ids if valid.all() else ids.filter(pa.array(valid)),
        offsets=offsets,
        users=flat_users,
        weights=None if weights is None else weights[valid],
        sources={file_index: path},
    )
    facts = ReadFacts(
        file_index,
        path,
        first_row,
        seen,
        ids.type if ids.null_count < n else None,
        flat.type if flat.null_count < len(flat) else None,
        suspect_users=_suspect_users(table, columns, valid, path, first_row) if columns.user_ids is None else None,
    )
    return FileResult(chunk, rejects, n, removed, facts)


def _typed_ids(ids: pa.Array, name: str, path: str) -> pa.Array:
    """The id column `name` as int64 or string ids (or all null), or an error naming the file and column."""
    if pa.types.is_large_string(ids.type):
        return _cast(ids, pa.string(), path, "ids")
    if pa.types.is_integer(ids.type):
        return _cast(ids, pa.int64(), path, "ids")
    if not pa.types.is_string(ids.type) and not pa.types.is_null(ids.type):
        raise InputError(f"{path}: id column {name!r} has type {ids.type}; expected integers or strings")
    return ids


def _weights(table: pa.Table, name: str) -> np.ndarray:
    """The weight column `name` as float64, NaN where null (rejected as bad_weight with the infinities)."""
    # integers beyond 2^53 round to the nearest double, as Arrow types a column of integers and floats
    return table.column(name).combine_chunks().cast(pa.float64(), safe=False).to_numpy(zero_copy_only=False)


def _reasons(
    ids: pa.Array,
    users: pa.ListArray,
    flat: pa.Array,
    weights: np.ndarray | None,
    non_conforming: dict[int, tuple[str, object]] | None,
) -> np.ndarray:
    """Each row's reason to be rejected, "" for none: its reason from parsing (`non_conforming`), else the
    first check it fails, in the order of `checks` (`flat`: `users` flattened)."""
    n = len(ids)
    reason = np.full(n, "", dtype=object)
    for row, (why, _) in (non_conforming or {}).items():
        reason[row] = why
    lengths = pc.list_value_length(users).to_numpy(zero_copy_only=False)
    user_null_in_row = np.zeros(n, dtype=bool)
    user_not_text_in_row = np.zeros(n, dtype=bool)
    if len(flat):
        parents = pc.list_parent_indices(users).to_numpy()
        np.logical_or.at(user_null_in_row, parents[flat.is_null().to_numpy(zero_copy_only=False)], True)
        np.logical_or.at(user_not_text_in_row, parents[_not_utf8(flat)], True)
    checks = [
        (_not_utf8(ids), BAD_ID_TYPE),
        (ids.is_null().to_numpy(zero_copy_only=False), MISSING_ID),
        (users.is_null().to_numpy(zero_copy_only=False), MISSING_USERS),
        (np.nan_to_num(lengths, nan=1) == 0, EMPTY_USERS),
        (user_null_in_row, NULL_USER),
        (user_not_text_in_row, BAD_USER_TYPE),
    ]
    if weights is not None:
        checks.append((~np.isfinite(weights), BAD_WEIGHT))
    unset = reason == ""
    for failed, why in checks:
        first = unset & failed
        reason[first] = why
        unset &= ~first
    return reason


def _rejects(
    table: pa.Table,
    reason: np.ndarray,
    non_conforming: dict[int, tuple[str, object]] | None,
    path: str,
    first_row: int,
) -> Rejects:
    """The rows with a `reason`, each as it was read: a non-conforming row's parsed value, else the table's row."""
    rejects = Rejects()
    for row in np.flatnonzero(reason != "").tolist():
        if non_conforming and row in non_conforming:
            record = non_conforming[row][1]
        else:
            record = _row_as_read(table, int(row))
        rejects.add(path, first_row + row, reason[row], record)
    return rejects


def _addressed_users(users: pa.ListArray, reason: np.ndarray, user_id_kind: str | None) -> pa.ListArray:
    """The users of the rows without a `reason`; under --user-ids email, string user ids replaced by the
    addresses they hold, and a row with a value that holds none given the reason bad_address (in `reason`)."""
    valid = reason == ""
    valid_users = users if valid.all() else users.filter(pa.array(valid))
    if user_id_kind != user_ids.EMAIL or not pa.types.is_string(valid_users.type.value_type):
        return valid_users
    valid_users, no_address = user_ids.email_users(valid_users)
    reason[np.flatnonzero(valid)[no_address]] = BAD_ADDRESS
    return valid_users.filter(pa.array(~no_address))


def _suspect_users(
    table: pa.Table, columns: Columns, valid: np.ndarray, path: str, first_row: int
) -> user_ids.SuspectUserIds | None:
    """The string user ids of the `valid` rows that show a sign of naming a person under several ids
    (`user_ids.find_suspects`), each users column on its own, so that a refusal names the column."""
    read = []
    for name in columns.user_sources:
        column = table.column(name).combine_chunks()
        if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
            values, rows = pc.list_flatten(column), pc.list_parent_indices(column).to_numpy(zero_copy_only=False)
        else:
            values, rows = column, np.arange(len(column))
        if pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
            keep = valid[rows] & values.is_valid().to_numpy(zero_copy_only=False)
            read.append((name, values.filter(pa.array(keep)), first_row + rows[keep]))
    return user_ids.find_suspects(path, read)


def _users_list(table: pa.Table, name: str, path: str) -> pa.Array:
    """The users column `name`: lists of int64 or string user ids, or an error naming the file and column."""
    users = table.column(name).combine_chunks()
    if pa.types.is_null(users.type):
        users = pa.nulls(len(table), pa.list_(pa.int64()))
    if not pa.types.is_list(users.type) and not pa.types.is_large_list(users.type):
        raise InputError(f"{path}: users column {name!r} has type {users.type}; expected a list")
    if pa.types.is_large_string(users.type.value_type):
        users = _cast(users, pa.list_(pa.string()), path, "user ids")
    elif pa.types.is_integer(users.type.value_type) or pa.types.is_null(users.type.value_type):
        users = _cast(users, pa.list_(pa.int64()), path, "user ids")
    elif not pa.types.is_string(users.type.value_type):
        raise InputError(
            f"{path}: users column {name!r} holds {users.type.value_type}; expected integer or string user ids"
        )
    return users


def _users_union(table: pa.Table, columns: Columns, path: str) -> pa.Array:
    """The users of each row under --users-columns: the values of those columns in their order, each
    column a user id or a list of them (null, "" and [] adding none; a null in a list is kept, a
    null_user as in `users`), as lists of int64 or string user ids. Never null: a row without any
    user has an empty list, rejected as empty_users. Repeats (a sender also in cc) are dropped later,
    as repeats within `users` are."""
    parents, values = zip(
        *(_column_users(table.column(name).combine_chunks(), name, path) for name in columns.users_columns)
    )
    kinds = {pa.types.is_integer(v.type) for v in values if not pa.types.is_null(v.type)}
    if len(kinds) > 1:
        raise mixed_ids(path, "user")
    target = pa.int64() if kinds != {False} else pa.string()
    flat = pa.concat_arrays([_cast(v, target, path, "user ids") for v in values])
    parent = np.concatenate(parents)
    order = np.argsort(parent, kind="stable")  # by row, then by column and position within it
    counts = np.bincount(parent, minlength=len(table))
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), flat.take(pa.array(order)))


def _column_users(column: pa.Array, name: str, path: str) -> tuple[np.ndarray, pa.Array]:
    """(row of each, user ids) that one --users-columns column adds: its non-empty scalars, or the
    elements of its lists; an error naming the file and column when it holds neither."""
    kind = column.type
    if pa.types.is_null(kind):
        return np.zeros(0, np.int64), column.slice(0, 0)
    if is_scalar_type(kind):
        if pa.types.is_integer(kind):
            present = column.is_valid()
        else:  # a null or an empty string: no user
            present = pc.not_equal(pc.fill_null(pc.binary_length(column), 0), 0)
        mask = present.to_numpy(zero_copy_only=False)
        return np.flatnonzero(mask).astype(np.int64), column.filter(present)
    if (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and (
        is_scalar_type(kind.value_type) or pa.types.is_null(kind.value_type)
    ):
        return pc.list_parent_indices(column).to_numpy().astype(np.int64), pc.list_flatten(column)
    raise InputError(
        f"{path}: users column {name!r} (--users-columns) has type {kind}; expected integer or string "
        f"user ids, or lists of them"
    )


def _not_utf8(values: pa.Array) -> np.ndarray:
    """True where a string value is not valid UTF-8: a Parquet string column can hold any bytes and
    Arrow does not check them when reading. Such a value is not a string, and no later stage could
    write it. Integers are never flagged."""
    if not pa.types.is_string(values.type):
        return np.zeros(len(values), dtype=bool)
    try:
        values.validate(full=True)  # checks the UTF-8 of the whole column at once
        return np.zeros(len(values), dtype=bool)
    except pa.ArrowInvalid:
        pass
    return np.array([not _decodes(v) for v in values.cast(pa.binary()).to_pylist()], dtype=bool)


def _decodes(value: bytes | None) -> bool:
    if value is None:
        return True
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _row_as_read(table: pa.Table, row: int) -> dict:
    """A table row as written to the rejects file; text that is not UTF-8 is kept as its bytes."""
    values = {}
    for name in table.column_names:
        value = table.column(name)[row]
        try:
            values[name] = value.as_py()
        except UnicodeDecodeError:
            as_bytes = pa.list_(pa.binary()) if pa.types.is_list(value.type) else pa.binary()
            values[name] = value.cast(as_bytes).as_py()
    return values


def _drop_repeated_users(users: pa.ListArray) -> tuple[np.ndarray, pa.Array, int]:
    """Keep the first occurrence of each user within each record."""
    flat = pc.list_flatten(users)
    if len(flat) == 0:
        return np.zeros(len(users) + 1, dtype=np.int64), flat, 0
    parents = pc.list_parent_indices(users).to_numpy().astype(np.int64)
    codes = _user_codes(flat, len(users))
    key = parents * (int(codes.max()) + 1) + codes  # by record, then by user (records x users < 2^63 in memory)
    order = np.argsort(key, kind="stable")  # a record's repeats of a user in their order in it
    repeat = np.zeros(len(codes), dtype=bool)
    repeat[order[1:][key[order][1:] == key[order][:-1]]] = True
    keep = ~repeat
    counts = np.bincount(parents[keep], minlength=len(users))
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return offsets, flat.filter(pa.array(keep)), int(repeat.sum())


def _user_codes(flat: pa.Array, records: int) -> np.ndarray:
    """Per user id, a number from 0, equal where the ids are: an integer id's offset from the smallest,
    where records times their span fits a sort key in 64 bits, else its index in the distinct ids."""
    if pa.types.is_integer(flat.type) and flat.null_count == 0:
        values = flat.to_numpy()
        low, high = int(values.min()), int(values.max())
        if records * (high - low + 1) < 2**63:
            return values - np.int64(low)
    return pc.dictionary_encode(flat).indices.to_numpy().astype(np.int64)
