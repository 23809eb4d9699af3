"""Reading one input file (JSON Lines, gzipped or not, or Parquet), whole or a split of it, into a
`RecordChunk` of its valid rows and the `Rejects` of the others, each with its reason (the rules:
`row_validation`), with the content columns the records carry; and the rules over whole files and
the whole input, judged from every read's facts (`check_facts`)."""

from __future__ import annotations

import codecs
import dataclasses
import enum
import gzip
import io
import itertools
import json
import math
import re
import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from madp.core import storage, user_ids
from madp.core.errors import InputError
from madp.core.records import (
    INVALID_JSON,
    ROW_KEY_BITS,
    Columns,
    FileResult,
    ReadFacts,
    RecordChunk,
    check_same_type,
)
from madp.core.row_validation import is_scalar_type, mixed_ids, row_problem, validate_rows


class ContentDefault(enum.Enum):
    """`content` of a read when no column is named: every column of the input other than the
    record's (id, users, weight), as the rows have them. `check_facts` then takes the content as
    the columns of every file, in order of first appearance (files in order, rows in order), so a
    file read in splits by many workers gives the content a whole read gives, with no read first."""

    OTHER_COLUMNS = "every column other than the record's"


OTHER_COLUMNS = ContentDefault.OTHER_COLUMNS
# The content a read carries: the columns named, every other column (OTHER_COLUMNS), or none (None).
Content = tuple[str, ...] | Literal[ContentDefault.OTHER_COLUMNS] | None

# The row rules of docs/how-to/your-data.md (What a JSON Lines row is, Invalid rows). The verifier
# implements them on its own (madp/core/verify/records.py).
# Arrays and objects nested deeper make a row invalid_json: Arrow's reader crashes (a segfault) on a
# row nested ~30k deep and json recurses until Python's limit, so neither may see such a row.
MAX_DEPTH = 100
_OPENERS = b"[{"
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # may write a lone surrogate; pairs are checked after parsing
# A JSON string, or an unterminated one up to the end: every match attempt succeeds, so it is linear.
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*(?:"|\\?\Z)', re.DOTALL)
_ALL_BUT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_ALL_BUT_OPENERS_AND_NEWLINES = bytes(b for b in range(256) if b not in b"[{\n")


def jsonl_lines(path: str) -> list[bytes]:
    """The rows of a JSON Lines file by the row rules (`jsonl_rows`)."""
    return jsonl_rows(_file_bytes(path))


def jsonl_rows(data: bytes, at_file_start: bool = True) -> list[bytes]:
    """The rows of JSON Lines bytes by the row rules (docs/how-to/your-data.md, What a JSON Lines row is): a UTF-8
    byte order mark at byte 0 of the (decompressed) file removed (`at_file_start`: `data` begins there); rows end at
    LF, one CR before it removed (LF and CRLF files read the same; a lone CR ends nothing); lines of only spaces,
    tabs and CRs skipped. Row numbers in errors and rejects count these rows from 0."""
    if at_file_start and data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8) :]
    if b"\r" not in data:
        return [line for line in data.split(b"\n") if line.strip(b" \t")]
    return [line.removesuffix(b"\r") for line in data.split(b"\n") if line.strip(b" \t\r")]


def _file_bytes(path: str) -> bytes:
    """A JSON Lines file's bytes, gunzipped for .gz; an unreadable, empty .gz or corrupt file is an error naming it."""
    try:
        with storage.open_input(path) as handle:
            data = handle.read()
    except OSError as error:
        raise InputError(f"{path}: cannot be read ({error.strerror or error})") from error
    return decompressed(path, data)


def decompressed(path: str, data: bytes) -> bytes:
    """A JSON Lines file's bytes as read, gunzipped for .gz; an empty or corrupt .gz is an error naming it."""
    if not path.endswith(".gz"):
        return data
    if not data:  # gzip.decompress(b"") is b"": an empty .gz is a failed write, not an empty file
        raise InputError(f"{path}: not a readable gzip file (0 bytes)")
    try:
        return gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as error:
        raise InputError(f"{path}: not a readable gzip file: {error}") from error


def _nesting_depth(line: bytes) -> int:
    """How deep arrays and objects nest in a JSON row: brackets counted outside strings only."""
    brackets = _STRING.sub(b"", line).translate(None, _ALL_BUT_BRACKETS)
    if not brackets:
        return 0
    steps = np.where(np.isin(np.frombuffer(brackets, np.uint8), np.frombuffer(_OPENERS, np.uint8)), 1, -1)
    return int(np.cumsum(steps).max())


def _too_deep(line: bytes) -> bool:
    return line.count(b"[") + line.count(b"{") > MAX_DEPTH and _nesting_depth(line) > MAX_DEPTH


def parse_row(line: bytes) -> Any:  # a JSON value, as json.loads gives it
    """A row's JSON value, or None where the row rules make it invalid_json: not strict UTF-8 (a UTF-16
    line, a byte order mark past byte 0), nested deeper than MAX_DEPTH, not one JSON value, or holding
    a lone surrogate (`"\\ud800"`: no UTF-8 text can carry it, so no later stage could write it)."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if _too_deep(line):
        return None
    try:
        value = json.loads(text)  # text, not bytes: json would guess UTF-16 or skip a BOM from bytes
    except ValueError:
        return None
    if _SURROGATE_ESCAPE.search(line) and not _is_unicode(value):
        return None
    return value


def _is_unicode(value: object) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _arrow_may_read(joined: bytes) -> bool:
    """Whether Arrow's reader sees the rows of `joined` (rows joined by LF) as the row rules do: Arrow
    reads invalid UTF-8 into its strings, takes a lone CR for a line end, refuses lone surrogates and
    crashes on deep nesting, so rows with any of these are parsed row by row."""
    if b"\r" in joined or _SURROGATE_ESCAPE.search(joined):
        return False
    if not joined.isascii():
        try:
            joined.decode("utf-8")
        except UnicodeDecodeError:
            return False
    openers = joined.translate(None, _ALL_BUT_OPENERS_AND_NEWLINES)  # per line, only its [ and {
    if not re.search(rb"[\[{]{%d}" % (MAX_DEPTH + 1), openers):
        return True
    return not any(_too_deep(line) for line in joined.split(b"\n"))  # no CR: LF alone ends the rows


def _arrow_json(lines: list[bytes]) -> pa.Table | None:
    """Arrow's fast JSON reader over `lines`, or None where it could disagree with one row per line.

    Arrow reads a value split over two lines, or two values on one line, as records and crashes on
    a top-level `null`; the row-by-row parse rejects such lines, so ids and content cannot shift."""
    if not all(line.lstrip().startswith(b"{") and line.rstrip().endswith(b"}") for line in lines):
        return None
    joined = b"\n".join(lines)
    if not _arrow_may_read(joined):
        return None
    try:
        table = pa_json.read_json(io.BytesIO(joined))
    except pa.ArrowInvalid:
        return None
    return table if len(table) == len(lines) else None


_SLICE = 1 << 22  # bytes searched for line ends at a time: masks of this size reuse memory


def _plain_records(data: bytes, source: str, columns: Columns) -> pa.Table | None:
    """The record columns of JSON Lines bytes whose every row is one object on a line of its own, LF
    ended, with no blank line (a file as programs write it), read by Arrow at once as the row-by-row
    parse reads them (`_parse_jsonl_rows`), or None where Arrow may not read them (`_arrow_may_read`).

    Arrow reads every row with the types the row-by-row parse gives the leading rows' record columns,
    and refuses a value of another type, so a table it gives holds the values and types that parse
    gives; None where it refuses one, where a leading row is not a record's, or where every row of a
    record column is null or lacks it (that a row has the column then rests on keys this read skips).
    The other columns are not read: their values, typed or not, have no say in the records."""
    if not data.startswith(b"{") or not data.endswith((b"}", b"}\n")) or not _arrow_may_read(data):
        return None
    as_array = np.frombuffer(data, np.uint8)
    line_ends = np.concatenate(  # in slices: no mask as large as the data
        [start + np.flatnonzero(as_array[start : start + _SLICE] == ord("\n")) for start in range(0, len(data), _SLICE)]
    )
    row_starts = line_ends[: len(line_ends) - data.endswith(b"\n")] + 1
    if not (as_array[line_ends - 1] == ord("}")).all() or not (as_array[row_starts] == ord("{")).all():
        return None
    rows = len(row_starts) + 1
    leading = [line.removesuffix(b"\n") for line in itertools.islice(io.BytesIO(data), LEADING_ROWS)]
    try:
        typed, problems, _ = _parse_jsonl_rows(source, leading, columns)
    except InputError:  # ids that mix types: the row-by-row parse of all rows names the file
        return None
    if problems:
        return None
    try:
        options = pa_json.ParseOptions(explicit_schema=typed.schema, unexpected_field_behavior="ignore")
        table = pa_json.read_json(pa.BufferReader(data), parse_options=options)
    except pa.ArrowInvalid:
        return None
    if len(table) != rows or any(column.null_count == rows for column in table.columns):
        return None
    return table


def read_file(path: str, file_index: int, columns: Columns, content: Content = None) -> FileResult:
    """Read one whole input file and split it into valid records and rejected rows; with `content`,
    also carry those columns of the valid records. The rules over a whole file and over the whole
    input are the caller's to check, once every file is read: `check_facts`."""
    if not path.endswith(".parquet"):
        return read_jsonl(_file_bytes(path), path, file_index, columns, content)
    names = parquet_read_columns(path, storage.parquet_columns(path), columns, content)
    return read_parquet_rows(storage.read_parquet(path, names), path, file_index, columns, content)


def read_jsonl(
    data: bytes,
    source: str,
    file_index: int,
    columns: Columns,
    content: Content = None,
    first_row: int = 0,
    at_file_start: bool = True,
) -> FileResult:
    """JSON Lines bytes (a whole file's, or a split's whole rows: `at_file_start` as `jsonl_rows` takes it)
    read and validated as `read_lines` reads their rows: at once where Arrow may read all of them
    (`_plain_records`), else row by row. The facts of a read at once name the record columns only, the
    columns the rules over whole files look at without `content`.

    Not at once with `content`, whose columns Arrow's reader would type, nor with a weight column: a
    rejected row shows an integer weight as Arrow types a whole file that it reads (an integer) or as
    the row-by-row parse does (a float), and which of the two reads a file rests on all its columns."""
    if content is None and not columns.weight:
        bom = at_file_start and data.startswith(codecs.BOM_UTF8)
        table = _plain_records(data[len(codecs.BOM_UTF8) :] if bom else data, source, columns)
        if table is not None:
            return validate_rows(table, None, source, file_index, columns, first_row, frozenset(table.column_names))
    return read_lines(jsonl_rows(data, at_file_start), source, file_index, columns, content, first_row)


def read_lines(
    lines: list[bytes],
    source: str,
    file_index: int,
    columns: Columns,
    content: Content = None,
    first_row: int = 0,
) -> FileResult:
    """JSON Lines rows (as `jsonl_rows` gives them) read and validated exactly as a file of them;
    `source` names them in errors and rejects. Rows of a split of a file are numbered from
    `first_row`, the rows of the file before them."""
    table, non_conforming, seen = _read_jsonl(source, lines, columns)
    result = validate_rows(table, non_conforming, source, file_index, columns, first_row, seen)
    if content is None:
        return result
    objects = [_json_object(line) for line in lines]
    names = _other_columns(_object_keys(objects), columns) if content is OTHER_COLUMNS else content
    return _with_content(result, _read_content(source, objects, names), first_row)


def _json_value(value):
    """json.dumps' fallback: a numpy array or scalar as its list or number; anything else is an error."""
    if isinstance(value, (np.ndarray, np.generic)):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not a JSON value")


def shown_row(row: object) -> str:
    """One's own row as an error names it: its first 300 characters."""
    return str(row)[:300]


def record_line(record: Mapping[str, Any], chunks: int, row: object) -> tuple[int, bytes]:
    """One's own row's record (a JSON Lines row's keys and values; `row`: the row, which errors show)
    as (chunk, one JSON line): the chunk of `chunks` is a hash of the line, so it does not depend on
    how a runner bundles the rows. A lone surrogate stays in the line as bytes that are not UTF-8,
    which reading rejects as `invalid_json`, as it does in a file."""
    try:
        text = json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=_json_value)
    except (TypeError, ValueError) as error:
        raise InputError(
            f"a row's record is not JSON (ids, users and content must be numbers, strings or lists of them; "
            f"decode bytes to str in content_extractor): {error}: on the row {shown_row(row)}"
        ) from error
    line = text.encode("utf-8", "surrogatepass")
    return zlib.crc32(line) % chunks, line


def read_row_chunk(index: int, lines: Iterable[bytes], columns: Columns, content: Content = None) -> FileResult:
    """A chunk of one's own rows, each as its record's JSON line (`madp.beam.record_chunks.RecordsFromRows`),
    read and validated as a JSON Lines file of them in the order of their JSON, so that the result is
    the same whatever order they came in; rejects name the chunk and a row's place in that order."""
    return read_lines(sorted(lines), f"rows of chunk {index}", index, columns, content)


def parquet_read_columns(path: str, found: list[str], columns: Columns, content: Content = None) -> list[str]:
    """The columns to read of a Parquet file whose schema has `found`: the record's, then `content`'s
    (every other one for OTHER_COLUMNS); an error naming the file when one of them is not there."""
    _require_columns(path, found, columns)
    names = _other_columns(found, columns) if content is OTHER_COLUMNS else content or ()
    missing = [n for n in names if n not in found]
    if missing:
        raise InputError(f"{path}: no content column {missing} (found {found})")
    return list(dict.fromkeys(_wanted(columns) + list(names)))


def read_parquet_rows(
    table: pa.Table,
    source: str,
    file_index: int,
    columns: Columns,
    content: Content = None,
    first_row: int = 0,
) -> FileResult:
    """Parquet rows (a whole file, or the row groups of a split from its row `first_row` on) with the
    columns `parquet_read_columns` names, validated."""
    seen = frozenset(table.column_names)  # a Parquet file's columns are its schema's, rows or not
    result = validate_rows(table.select(_wanted(columns)), None, source, file_index, columns, first_row, seen)
    if content is None:
        return result
    names = _other_columns(table.column_names, columns) if content is OTHER_COLUMNS else content
    return _with_content(result, table.select(list(names)), first_row)


def _with_content(result: FileResult, content: pa.Table, first_row: int) -> FileResult:
    """`result` with the content of its valid records (`content`: of every row read), and the
    content's columns and types among its facts."""
    rows = (result.chunk.keys & ((1 << ROW_KEY_BITS) - 1)) - first_row
    result.chunk.content = content.take(pa.array(rows))
    seen = result.facts.columns or frozenset()
    present = pa.schema([f for f in content.schema if f.name in seen])
    return dataclasses.replace(result, facts=result.facts._replace(content=present))


def content_columns(path: str, columns: Columns) -> tuple[str, ...]:
    """The columns of one input file other than the id, users and weight columns, in order of first
    appearance (the whole file is read: for tools that read it anyway, not for a pipeline's driver)."""
    if path.endswith(".parquet"):
        return _other_columns(storage.parquet_columns(path), columns)
    lines = jsonl_lines(path)
    table = _arrow_json(lines)
    names = table.column_names if table is not None else _object_keys(map(_json_object, lines))
    return _other_columns(names, columns)


# Rows of a JSON Lines file read before the whole of it: by `missing_columns`, and by `_plain_records`
# to type the record columns.
LEADING_ROWS = 1000


def missing_columns(path: str, names: Iterable[str]) -> list[str]:
    """Which of `names` no row of the input file `path` has (`_present_columns`: a check before a pipeline,
    cheap on a file that has them)."""
    wanted = list(dict.fromkeys(names))
    found = _present_columns(path, wanted)
    return [name for name in wanted if name not in found]


def _present_columns(path: str, names: list[str]) -> set[str]:
    """The columns of the input file `path`, as far as a check of `names` needs them: a Parquet file's
    schema; the keys of a JSON Lines file's first rows, and only where one of `names` is missing there, of
    all its rows."""
    if path.endswith(".parquet"):
        return set(storage.parquet_columns(path))
    found = set(_object_keys(map(_json_object, _leading_rows(path))))
    if all(name in found for name in names):
        return found
    return set(_object_keys(map(_json_object, jsonl_lines(path))))


def _leading_rows(path: str) -> list[bytes]:
    """The first LEADING_ROWS rows of a JSON Lines file (none where it cannot be read: its reader, on the
    whole file, names what is wrong with it)."""
    blocks, lines, whole = [], 0, False
    try:  # in blocks: pyarrow's files read no lines
        with storage.open_input(path) as raw, gzip.open(raw) if path.endswith(".gz") else raw as handle:
            while lines < LEADING_ROWS and not whole:
                block = handle.read(1 << 20)
                blocks.append(block)
                lines, whole = lines + block.count(b"\n"), not block
    except (OSError, EOFError, zlib.error):
        return []
    head = b"".join(blocks)
    return jsonl_rows(head if whole else head[: head.rfind(b"\n") + 1])[:LEADING_ROWS]  # whole rows only


def leading_facts(path: str, columns: Columns) -> ReadFacts:
    """What the first rows of an input file show (its first LEADING_ROWS rows, read as the whole file is):
    a driver's cheap look at the input, its id and user id types, before a pipeline reads all of it; never
    a whole row group, which a Parquet writer may make of millions of rows. A record column that no row of
    the file has is an InputError, as reading the whole file says it."""
    _require_columns(path, _present_columns(path, _wanted(columns)), columns)
    if not path.endswith(".parquet"):
        return read_lines(_leading_rows(path), path, 0, columns).facts
    try:
        with storage.open_input(path) as handle:
            parquet = pq.ParquetFile(handle, page_checksum_verification=True)
            names = parquet_read_columns(path, parquet.schema_arrow.names, columns)
            batches = (
                parquet.iter_batches(LEADING_ROWS, row_groups=[0], columns=names) if parquet.num_row_groups else ()
            )
            leading = next(iter(batches), None)
            table = parquet.schema_arrow.empty_table().select(names) if leading is None else pa.table(leading)
    except (pa.ArrowInvalid, OSError) as error:
        raise InputError(f"{path}: not a readable Parquet file ({error})") from error
    return read_parquet_rows(table, path, 0, columns).facts


def _object_keys(objects: Iterable[dict]) -> list[str]:
    """The keys of `objects`, in order of first appearance (the order Arrow's JSON reader gives)."""
    return list(dict.fromkeys(key for obj in objects for key in obj))


def _other_columns(names: Iterable[str], columns: Columns) -> tuple[str, ...]:
    """`names` without the record's columns (id, users, weight)."""
    wanted = _wanted(columns)
    return tuple(n for n in names if n not in wanted)


def _json_object(line: bytes) -> dict:
    """A line's JSON object, or {} for a line that is not one."""
    obj = parse_row(line)
    return obj if isinstance(obj, dict) else {}


def _read_content(path: str, objects: list[dict], names: tuple[str, ...]) -> pa.Table:
    """Columns `names` of the JSON Lines rows' `objects` (rows that are not JSON objects, read as {},
    or lack a column, read as nulls; a column no row has is all nulls, for `check_facts` to judge)."""
    arrays = {}
    for name in names:
        try:
            arrays[name] = pa.array([obj.get(name) for obj in objects])
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as error:  # OverflowError: an int beyond 64 bits
            raise InputError(f"{path}: content column {name!r} mixes types: {error}") from error
    return pa.table(arrays) if arrays else pa.table({"_": pa.nulls(len(objects))}).drop(["_"])


def _wanted(columns: Columns) -> list[str]:
    """The input columns a record is read from: its id, users (one list column, or `--users-columns`) and weight."""
    return [c for c in (columns.id, *columns.user_sources, columns.weight) if c]


def _require_columns(path: str, found: Iterable[str], columns: Columns) -> None:
    missing = [c for c in _wanted(columns) if c not in found]
    if missing:
        raise InputError(
            f"{path}: no column {missing} in any row (found {sorted(found)}); "
            f"name the columns with --id-column, --users-column (or --users-columns) or --weight-column"
        )


def _read_jsonl(
    path: str, lines: list[bytes], columns: Columns
) -> tuple[pa.Table, dict[int, tuple[str, object]] | None, frozenset[str] | None]:
    """The record columns of JSON Lines rows (a column no row has is all nulls), the rows that cannot
    be typed with their reason, and the columns some row has (None when no row is a JSON object).
    Fast path through Arrow; rows Arrow cannot type are parsed one by one to name the bad row."""
    if not lines:
        return _empty_table(columns), None, None
    table = _arrow_json(lines)
    if table is None:
        return _parse_jsonl_rows(path, lines, columns)
    seen = frozenset(table.column_names)
    for name in _wanted(columns):
        if name not in seen:
            table = table.append_column(name, pa.nulls(len(table)))
    if _conforming(table, columns):
        return table.select(_wanted(columns)), None, seen
    return _parse_jsonl_rows(path, lines, columns)


def _conforming(table: pa.Table, columns: Columns) -> bool:
    """Whether Arrow typed every record column as the records need (else the rows are parsed one by one)."""
    id_type = table.schema.field(columns.id).type
    users_types = [table.schema.field(name).type for name in columns.user_sources]
    return (
        is_scalar_type(id_type)
        and all(_users_type_conforms(kind, columns) for kind in users_types)
        and (
            not columns.weight
            or pa.types.is_integer(table.schema.field(columns.weight).type)
            or pa.types.is_floating(table.schema.field(columns.weight).type)
        )
    )


def _users_type_conforms(kind: pa.DataType, columns: Columns) -> bool:
    """A list of user ids; with --users-columns also a scalar one, or all nulls (a column of nulls or
    empty lists adds no user, which `row_validation._users_union` reads as it reads any other)."""
    if not columns.users_columns:
        return pa.types.is_list(kind) and is_scalar_type(kind.value_type)
    if pa.types.is_list(kind):
        kind = kind.value_type
    return is_scalar_type(kind) or pa.types.is_null(kind)


def _empty_table(columns: Columns) -> pa.Table:
    fields = [pa.field(columns.id, pa.int64())]
    fields += [pa.field(name, pa.list_(pa.int64())) for name in columns.user_sources]
    if columns.weight:
        fields.append(pa.field(columns.weight, pa.float64()))
    return pa.Table.from_pylist([], schema=pa.schema(fields))


def _as_user_list(value: object) -> list | None:
    """A --users-columns value as a list of user ids: a scalar as one, an empty string as none (a null
    stays null, which adds no user either)."""
    if value is None or isinstance(value, list):
        return value
    return [] if value == "" else [value]


def _parse_jsonl_rows(
    path: str, lines: list[bytes], columns: Columns
) -> tuple[pa.Table, dict[int, tuple[str, object]], frozenset[str] | None]:
    """Row-by-row parse, one row per line: rows with wrongly typed fields are blanked and their reason
    kept; also the columns some row has (None when no row is a JSON object)."""
    ids: list[object] = []
    users: dict[str, list[Any]] = {name: [] for name in columns.user_sources}  # per column, each row's list or None
    weights: list[object] = []
    problems: dict[int, tuple[str, object]] = {}
    seen: set[str] = set()
    for row, line in enumerate(lines):
        obj = parse_row(line)
        if not isinstance(obj, dict):
            problems[row] = (INVALID_JSON, line.decode("utf-8", "replace"))
        else:
            seen.update(obj)
            if (why := row_problem(obj, columns)) is not None:
                problems[row] = (why, obj)
        if row in problems:
            ids.append(None)
            for values in users.values():
                values.append(None)
            weights.append(None)
        else:
            ids.append(obj.get(columns.id))
            for name, values in users.items():
                value = obj.get(name)
                values.append(_as_user_list(value) if columns.users_columns else value)
            weights.append(_as_float(obj.get(columns.weight)) if columns.weight else None)
    id_array = _unify_scalars(ids, path, "id")
    every_user = [u for values in users.values() for us in values if us for u in us]
    value_type = _unify_scalars(every_user, path, "user").type
    arrays = {columns.id: id_array}
    arrays.update({name: pa.array(values, type=pa.list_(value_type)) for name, values in users.items()})
    if columns.weight:
        arrays[columns.weight] = pa.array(weights, type=pa.float64())
    any_object = len(lines) > sum(why == INVALID_JSON for why, _ in problems.values())
    return pa.table(arrays), problems, frozenset(seen) if any_object else None


def _as_float(weight: int | float | None) -> float | None:
    """A weight as a double: integers beyond 2^53 rounded, beyond the doubles infinite (a bad_weight)."""
    try:
        return None if weight is None else float(weight)
    except OverflowError:
        return math.inf


def _unify_scalars(values: list, path: str, what: str) -> pa.Array:
    kinds = {type(v) for v in values if v is not None}
    if kinds == {int, str}:
        raise mixed_ids(path, what)
    kind = kinds.pop() if kinds else int
    return pa.array(values, type=pa.string() if kind is str else pa.int64())


def check_facts(facts: Sequence[ReadFacts], columns: Columns, content: Content = None) -> pa.Schema | None:
    """The rules over whole files and over the whole input, judged from the facts of every read (each
    file, or each split of one, in any order: they are put in file and row order), so that a file
    reads the same whole or in splits:
    - a file some of whose rows are JSON objects, none of which has a record column, is an error;
    - ids (or user ids) that are integers in some rows and strings in others are an error, within a
      file and across files (rows that are not valid records count too);
    - string user ids of valid records showing a sign of naming a person under several ids (read
      without `--user-ids`: `user_ids.SIGNS`) are an error naming the first few of each sign;
    - a content column that no row of a file has is an error; its types, in the splits of a file and
      across files, unify as Arrow reads one file (integers and floats read as floats), or are an error.
    Returns the content schema, in `content`'s order, that every chunk's content takes
    (`conform_content`); None without `content`. For OTHER_COLUMNS the content is every column some
    read has, in order of first appearance (files, then rows, in order)."""
    by_file: dict[int, list[ReadFacts]] = {}
    for fact in facts:
        by_file.setdefault(fact.file_index, []).append(fact)
    in_order = [sorted(by_file[index], key=lambda read: read.first_row) for index in sorted(by_file)]
    named = content is not OTHER_COLUMNS
    if content is OTHER_COLUMNS:
        found = [r.content for reads in in_order for r in reads if r.content is not None]
        content = tuple(dict.fromkeys(name for schema in found for name in schema.names))
    id_types: list[pa.DataType] = []
    user_types: list[pa.DataType] = []
    file_schemas: list[pa.Schema] = []
    for reads in in_order:  # each file's reads, unified in row order, as read whole
        source = reads[0].source
        for what, types in (("id", {r.id_type for r in reads}), ("user", {r.user_type for r in reads})):
            if len(types - {None}) > 1:
                raise mixed_ids(source, what)
        seen = [read.columns for read in reads if read.columns is not None]
        if seen:
            _require_columns(source, frozenset().union(*seen), columns)
        id_types.extend(t for t in {r.id_type for r in reads} if t is not None)
        user_types.extend(t for t in {r.user_type for r in reads} if t is not None)
        if content is not None:
            schemas = [r.content for r in reads if r.content is not None]
            file_schemas.append(_file_content(source, schemas, content, named))
    check_same_type(id_types, "record")
    check_same_type(user_types, "user")
    refused = user_ids.refusal([r.suspect_users for reads in in_order for r in reads if r.suspect_users])
    if refused:
        raise InputError(refused)
    if content is None:
        return None
    try:
        unified = pa.unify_schemas(file_schemas, promote_options="permissive") if file_schemas else pa.schema([])
    except (pa.ArrowInvalid, pa.ArrowTypeError) as error:
        raise InputError(f"content columns have different types in different input files: {error}") from error
    return pa.schema([unified.field(name) if name in unified.names else pa.field(name, pa.null()) for name in content])


def _file_content(source: str, schemas: list[pa.Schema], content: tuple[str, ...], named: bool) -> pa.Schema:
    """One file's content schema from its splits': every column in some row, types unified (`named`:
    the columns were named with --content-columns, not found in other files)."""
    fields = []
    for name in content:
        found = [pa.schema([schema.field(name)]) for schema in schemas if name in schema.names]
        if not found:
            where = "" if named else " (other input files have it: choose the columns to carry with --content-columns)"
            raise InputError(f"{source}: no content column {name!r} in any row{where}")
        try:
            fields.append(pa.unify_schemas(found, promote_options="permissive").field(name))
        except (pa.ArrowInvalid, pa.ArrowTypeError) as error:
            raise InputError(f"{source}: content column {name!r} mixes types: {error}") from error
    return pa.schema(fields)


def conform_content(chunk: RecordChunk, schema: pa.Schema | None) -> RecordChunk:
    """`chunk` with its content cast to `schema`, as `check_facts` unified it over the whole input: a
    column none of its rows has (read with OTHER_COLUMNS) is all nulls; one the input's content
    does not have is not carried."""
    content = chunk.content
    if schema is None or content is None or content.schema == schema:
        return chunk
    rows = len(chunk)  # not len(content): a table of no columns (a split whose rows have only the record's) has no rows
    columns = [content.column(n) if n in content.column_names else pa.nulls(rows, pa.null()) for n in schema.names]
    try:
        return dataclasses.replace(chunk, content=pa.table(columns, names=schema.names).cast(schema))
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as error:
        sources = ", ".join(sorted(chunk.sources.values()))
        raise InputError(f"{sources}: content does not convert to the input's types {schema}: {error}") from error
