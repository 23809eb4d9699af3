"""The input records as the verifiers read them, by the row rules of docs/how-to/your-data.md alone: the input
files of a path, each row's id, users and content, the rows no engine keeps left out; and where a record's users are
(`_UsersFrom`)."""

from __future__ import annotations

import gzip
import json
import os
import zlib
from collections.abc import Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from madp.core.verify.user_ids import _addresses, _Suspects

_SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")
_HIDDEN = (".", "_")  # names skipped below an input directory, of files and of directories
_MAX_DEPTH = 100  # the row rules: a row nesting arrays and objects deeper is invalid
_INT64 = (-(2**63), 2**63 - 1)


def _input_files(path: str) -> list[str]:
    """The input files of a path: the path itself, or every .jsonl, .jsonl.gz and .parquet file below a
    directory, no name below it starting with '.' or '_' (`.ipynb_checkpoints/`, Spark's `_temporary/`).
    Links are followed; a link back to a directory above it (a loop), or a directory that cannot be
    listed, is listed itself, and reading it (`_rows`) is a violation."""
    if not os.path.isdir(path):
        return [path]
    found = []
    pending = [(path, frozenset({_identity(path)}))]
    while pending:
        directory, above = pending.pop()
        try:
            names = os.listdir(directory)
        except OSError:
            found.append(directory)
            continue
        for name in names:
            child = os.path.join(directory, name)
            if name.startswith(_HIDDEN):
                continue
            if os.path.isdir(child):
                identity = _identity(child)
                if identity in above:
                    found.append(child)
                else:
                    pending.append((child, above | {identity}))
            elif name.endswith(_SUFFIXES) and os.path.isfile(child):
                found.append(child)
    return sorted(found)


def _identity(directory: str) -> tuple[int, int]:
    status = os.stat(directory)
    return status.st_dev, status.st_ino


def _scalar(value) -> bool:
    """A string or a 64-bit integer (a boolean is neither)."""
    return isinstance(value, str) or (
        isinstance(value, int) and not isinstance(value, bool) and _INT64[0] <= value <= _INT64[1]
    )


class _UsersFrom:
    """Where a record's users are: the list column `users`, or (`--users-columns`) several columns,
    each a user id or a list of them, whose values' union the users are; and how string user ids are
    read (`--user-ids`): None, as they are, each showing a sign of naming a person under several ids
    noted; "email", as the addresses they hold; "as-is", as they are."""

    def __init__(self, users_column: str, users_columns: Iterable[str] = (), user_ids: str | None = None):
        listed = list(users_columns)
        self.columns = listed or [users_column]
        self.union = bool(listed)
        self.user_ids = user_ids

    def users(self, values: list):
        """A row's users from its users columns' values, re-derived here from the data alone: the list
        column's value as it is; or in column order a user id as one user, a list's elements, and a
        null, an empty string or an empty list as none. The caller judges what it holds."""
        if not self.union:
            return values[0]
        users: list = []
        for value in values:
            if isinstance(value, list):
                users.extend(value)
            elif value is not None and value != "":
                users.append(value)
        return users

    def flags(self) -> str:
        return f"--users-columns {','.join(self.columns)}" if self.union else f"--users-column {self.columns[0]}"


def _rows(path: str, id_column: str, users_from: _UsersFrom, suspects: _Suspects, content: tuple[str, ...] = ()):
    """(id, users, content) of every row with a string or 64-bit integer id and a non-empty list of such
    users, as read from disk, `content` the row's values of the `content` columns (None where it has
    none); other rows (undecodable, not JSON objects, nested too deep, a lone surrogate, text that is not
    UTF-8, list ids, nested users) are invalid and no engine keeps them. Under --user-ids email a string
    user is the addresses it holds, and a row with a value holding none is invalid; without --user-ids
    each user showing a sign is noted in `suspects`. Streamed: a Parquet file a batch of rows at a time,
    a JSON Lines file a line at a time."""
    if os.path.isdir(path):
        raise ValueError("a directory that cannot be listed, or a link to a directory above it (a loop)")
    if path.endswith(".parquet"):
        rows = _parquet_rows(path, id_column, users_from, content)
    else:
        rows = (_json_row(line, id_column, users_from, content) for line in _json_lines(path))
    for row, (record_id, values, found) in enumerate(rows):
        if values is None:
            continue
        users = users_from.users(values)
        if not (_scalar(record_id) and isinstance(users, list) and users and all(_scalar(u) for u in users)):
            continue
        if users_from.user_ids == "email":
            read = [_addresses(u) if isinstance(u, str) else [u] for u in users]
            if not all(read):
                continue
            users = [address for addresses in read for address in addresses]
        elif users_from.user_ids is None:
            suspects.note(path, row, users_from.columns, values)
        yield record_id, users, found


def _parquet_rows(path: str, id_column: str, users_from: _UsersFrom, content: tuple[str, ...]):
    """(id, its users columns' values, content) of each row of a Parquet file, 65,536 rows in memory at a
    time; a content column the file lacks reads as None."""
    source = pq.ParquetFile(path, page_checksum_verification=True)
    held = [name for name in content if name in source.schema_arrow.names]
    names = list(dict.fromkeys([id_column, *users_from.columns, *held]))
    for batch in source.iter_batches(columns=names):
        users = [_column_values(batch.column(name)) for name in users_from.columns]
        found = {name: _column_values(batch.column(name)) for name in held}
        values = [found.get(name, [None] * batch.num_rows) for name in content]
        yield from zip(
            _column_values(batch.column(id_column)),
            map(list, zip(*users)),
            zip(*values) if values else [()] * batch.num_rows,
        )


def _column_values(column) -> list:
    """A Parquet column's values as Python; a string that is not UTF-8 (Parquet stores any bytes) stays
    bytes, which is no id and no user."""
    try:
        return column.to_pylist()
    except UnicodeDecodeError:
        return [_text(value) for value in column.cast(_bytes_type(column.type)).to_pylist()]


def _bytes_type(kind):
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return pa.list_(_bytes_type(kind.value_type))
    return pa.binary() if pa.types.is_string(kind) or pa.types.is_large_string(kind) else kind


def _text(value):
    if isinstance(value, list):
        return [_text(v) for v in value]
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return value
    return value


def _readable_rows(
    path: str, id_column: str, users_from: _UsersFrom, violations: list[str], suspects: _Suspects, content=()
):
    """`_rows` of a file, and a violation where the file cannot be read (further)."""
    try:
        yield from _rows(path, id_column, users_from, suspects, content)
    except (OSError, ValueError, KeyError, EOFError, zlib.error) as error:
        violations.append(f"{path}: cannot be read ({error})")


def _json_lines(path: str):
    """The rows of a JSON Lines file by the row rules (docs/how-to/your-data.md, What a JSON Lines row is), one at a
    time: a UTF-8 byte order mark only at byte 0 of the (gunzipped) file; a row ends at LF, a CR just before it
    dropped (a lone CR ends nothing); rows of only spaces, tabs and CRs skipped. An empty .gz is unreadable, not an
    empty file."""
    if path.endswith(".gz") and os.path.getsize(path) == 0:
        raise ValueError("an empty gzip file (0 bytes)")
    with gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb") as handle:
        for number, line in enumerate(handle):
            line = line[3:] if number == 0 and line.startswith(b"\xef\xbb\xbf") else line
            line = line[:-1] if line.endswith(b"\n") else line
            line = line[:-1] if line.endswith(b"\r") else line
            if line.strip(b" \t\r"):
                yield line


def _json_row(line: bytes, id_column: str, users_from: _UsersFrom, content: tuple[str, ...]):
    """(id, its users columns' values, content) of a row, or Nones where the row rules make it invalid:
    not strict UTF-8, nested deeper than _MAX_DEPTH, not a JSON object, or a lone surrogate in any of its
    strings."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        return None, None, ()
    if text.count("[") + text.count("{") > _MAX_DEPTH and _depth(text) > _MAX_DEPTH:
        return None, None, ()
    try:
        row = json.loads(text)
    except ValueError:
        return None, None, ()
    if not isinstance(row, dict) or ("\\u" in text and _holds_lone_surrogate(row)):
        return None, None, ()
    return row.get(id_column), [row.get(name) for name in users_from.columns], tuple(row.get(name) for name in content)


def _depth(text: str) -> int:
    """The deepest nesting of arrays and objects in JSON text, read character by character outside strings."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def _holds_lone_surrogate(value) -> bool:
    if isinstance(value, str):
        return any("\ud800" <= char <= "\udfff" for char in value)
    if isinstance(value, dict):
        return any(_holds_lone_surrogate(k) or _holds_lone_surrogate(v) for k, v in value.items())
    return isinstance(value, list) and any(_holds_lone_surrogate(v) for v in value)
