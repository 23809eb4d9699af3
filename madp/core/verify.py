"""Independent checks of a bounding output (no user over its bound, no unknown selected id) and of
batches (the bound re-derived from the records, the selection and the batches: only selected
records, within their copies, no user over K; min-sep between a user's participations,
participations, sizes).

Deliberately shares no code with the reader, the kernels or the engines: it re-reads the input
with plain pyarrow / json, and counts contributions with Python dictionaries. One file over
~350 lines on purpose: it imports no other module of madp (`tests/test_import_graph.py` checks
it), so it is the whole of what a reviewer reads to trust the two verifiers.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import json
import os
import re
import zlib
from collections import Counter, defaultdict
from collections.abc import Iterable
from email.utils import getaddresses

import pyarrow as pa
import pyarrow.parquet as pq

_SHOWN = 20


_SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")
_HIDDEN = (".", "_")  # names skipped below an input directory, of files and of directories
_MAX_DEPTH = 100  # the README's row rules: a row nesting arrays and objects deeper is invalid
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


# The signs that a string user id may name a person who is also written another way (README, Input).
_SIGNS = {
    "several_addresses": "several addresses in one value",
    "display_name": "an address in angle brackets",
    "surrounding_whitespace": "whitespace around the id",
    "upper_case": "an address with upper-case letters",
}
_ANGLE_ADDRESS = re.compile(r"<[^<>]*@[^<>]*>")
_UPPER = re.compile(r"[A-Z]")


def _signs_of(user: str) -> list[str]:
    """The signs a string user id shows: ',' or ';' with two '@' or more; an address in angle brackets;
    whitespace (str.isspace's) around it; one '@', no whitespace and an upper-case letter A-Z."""
    at_signs = user.count("@")
    shown = {
        "several_addresses": at_signs >= 2 and ("," in user or ";" in user),
        "display_name": bool(_ANGLE_ADDRESS.search(user)),
        "surrounding_whitespace": user != user.strip(),
        "upper_case": at_signs == 1 and not any(c.isspace() for c in user) and bool(_UPPER.search(user)),
    }
    return [sign for sign, found in shown.items() if found]


def _addresses(user: str) -> list[str]:
    """The e-mail addresses a user value holds (--user-ids email): email.utils.getaddresses over the
    value split at ';' (it splits at ',' itself), each address stripped and lower-cased, those with an '@'."""
    found = [address.strip().lower() for _, address in getaddresses(user.split(";"))]
    return [address for address in found if "@" in address]


class _Suspects:
    """The string user ids of valid rows that show a sign, read without --user-ids: how many per sign,
    and the first few of each (file, row, column, value)."""

    def __init__(self) -> None:
        self.count: Counter = Counter()
        self.shown: defaultdict = defaultdict(list)

    def note(self, path: str, row: int, columns: list[str], values: list) -> None:
        for column, value in zip(columns, values):
            for user in value if isinstance(value, list) else [value]:
                for sign in _signs_of(user) if isinstance(user, str) else ():
                    self.count[sign] += 1
                    if len(self.shown[sign]) < 3:
                        self.shown[sign].append(f"{path} row {row} column {column!r}: {user!r}")

    def violations(self) -> list[str]:
        if not self.count:
            return []
        found = ", ".join(
            f"{sign}: {self.count[sign]} ({_SIGNS[sign]}; e.g. {'; '.join(self.shown[sign])})"
            for sign in _SIGNS
            if self.count[sign]
        )
        return [
            f"string user ids that may name one person under several ids, each then bounded on its own: {found}; "
            f"no engine reads them without --user-ids email or --user-ids as-is"
        ]


def _rows(path: str, id_column: str, users_from: _UsersFrom, suspects: _Suspects):
    """(id, users) of every row with a string or 64-bit integer id and a non-empty list of such users, as
    read from disk; other rows (undecodable, not JSON objects, nested too deep, a lone surrogate, text
    that is not UTF-8, list ids, nested users) are invalid and no engine keeps them. Under --user-ids
    email a string user is the addresses it holds, and a row with a value holding none is invalid;
    without --user-ids each user showing a sign is noted in `suspects`."""
    if os.path.isdir(path):
        raise ValueError("a directory that cannot be listed, or a link to a directory above it (a loop)")
    pairs: Iterable[tuple[object, list | None]]
    if path.endswith(".parquet"):
        table = pq.read_table(path, columns=[id_column, *users_from.columns], page_checksum_verification=True)
        columns = [_column_values(table.column(name)) for name in users_from.columns]
        pairs = zip(_column_values(table.column(id_column)), map(list, zip(*columns)))
    else:
        pairs = (_json_pair(line, id_column, users_from) for line in _json_lines(path))
    for row, (record_id, values) in enumerate(pairs):
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
        yield record_id, users


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
    path: str, id_column: str, users_from: _UsersFrom, violations: list[str], suspects: _Suspects
) -> list:
    """`_rows` of a file, or none and a violation when the file cannot be read at all."""
    try:
        return list(_rows(path, id_column, users_from, suspects))
    except (OSError, ValueError, KeyError, EOFError, zlib.error) as error:
        violations.append(f"{path}: cannot be read ({error})")
        return []


def _json_lines(path: str) -> list[bytes]:
    """The rows of a JSON Lines file by the README's row rules: a UTF-8 byte order mark only at byte 0
    of the (gunzipped) file; a row ends at LF, a CR just before it dropped (a lone CR ends nothing);
    rows of only spaces, tabs and CRs skipped. An empty .gz is unreadable, not an empty file."""
    if path.endswith(".gz"):
        if os.path.getsize(path) == 0:
            raise ValueError("an empty gzip file (0 bytes)")
        with gzip.open(path, "rb") as handle:
            data = handle.read()
    else:
        with open(path, "rb") as handle:
            data = handle.read()
    data = data[3:] if data.startswith(b"\xef\xbb\xbf") else data
    rows = []
    for line in data.split(b"\n"):
        line = line[:-1] if line.endswith(b"\r") else line
        if line.strip(b" \t\r"):
            rows.append(line)
    return rows


def _json_pair(line: bytes, id_column: str, users_from: _UsersFrom):
    """(id, its users columns' values) of a row, or (None, None) where the row rules make it invalid: not
    strict UTF-8, nested deeper than _MAX_DEPTH, not a JSON object, or a lone surrogate in any of its strings."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        return None, None
    if text.count("[") + text.count("{") > _MAX_DEPTH and _depth(text) > _MAX_DEPTH:
        return None, None
    try:
        row = json.loads(text)
    except ValueError:
        return None, None
    if not isinstance(row, dict) or ("\\u" in text and _holds_lone_surrogate(row)):
        return None, None
    return row.get(id_column), [row.get(name) for name in users_from.columns]


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


def _capacities(path: str | None) -> tuple[dict, bool]:
    """({user: capacity}, whether the users are text): a CSV's user ids are text, matched to the exact
    text of an input user id; JSON Lines and Parquet ids are typed, matched by type and value. A UTF-8
    byte order mark at the start of a CSV or JSON Lines file is not part of its first row."""
    if path is None:
        return {}, False
    if path.endswith(".parquet"):
        table = pq.read_table(path, page_checksum_verification=True)
        return dict(zip(table.column("user").to_pylist(), table.column("capacity").to_pylist())), False
    if path.endswith(".csv"):
        with open(path, newline="", encoding="utf-8-sig") as handle:
            return {r["user"]: int(r["capacity"]) for r in csv.DictReader(handle)}, True
    rows = [json.loads(line.decode("utf-8")) for line in _json_lines(path)]
    return {r["user"]: r["capacity"] for r in rows}, False


def _other_users_columns(bound_output: str, users_from: _UsersFrom, command: str) -> list[str]:
    """A violation when the bound's report.json records other users columns, or another --user-ids, than
    the verifier was given: the verifier would then re-derive the bound of another graph than the one
    bounded. What a report does not record (or a report that cannot be read: `_listed_files` says so)
    is not judged here."""
    try:
        with open(os.path.join(bound_output, "report.json"), "rb") as handle:
            parameters = json.loads(handle.read().decode("utf-8")).get("parameters")
    except (OSError, ValueError, AttributeError):
        return []
    if not isinstance(parameters, dict):
        return []
    violations = []
    if "users_columns" in parameters or "users_column" in parameters:
        listed = parameters.get("users_columns")
        bound_from = _UsersFrom(
            str(parameters.get("users_column") or "users"), listed if isinstance(listed, list) else ()
        )
        if (bound_from.union, bound_from.columns) != (users_from.union, users_from.columns):
            violations.append(
                f"{bound_output} was bounded with {bound_from.flags()}, but {command} was given "
                f"{users_from.flags()}: pass the users columns the bound read"
            )
    if "user_ids" in parameters and parameters["user_ids"] != users_from.user_ids:
        read = parameters["user_ids"]
        violations.append(
            f"{bound_output} read the user ids {f'with --user-ids {read}' if read else 'without --user-ids'}, but "
            f"{command} was given {f'--user-ids {users_from.user_ids}' if users_from.user_ids else 'none'}: "
            f"pass the --user-ids the bound read them with"
        )
    return violations


def _inside(name: str) -> bool:
    """Whether a listed name stays inside its folder: relative, no '..' part. A tampered report must not
    make the verifier read (and vouch for) a file elsewhere."""
    return bool(name) and not os.path.isabs(name) and ".." not in name.replace("\\", "/").split("/")


def _entry_problem(entry, report_path: str, root: str) -> str | None:
    if not (
        isinstance(entry, dict)
        and isinstance(entry.get("name"), str)
        and isinstance(entry.get("bytes"), int)
        and isinstance(entry.get("sha256"), str)
    ):
        return f"{report_path} lists {entry!r}, not a file entry (name, bytes, sha256)"
    if not _inside(entry["name"]):
        return f"{report_path} lists {entry['name']!r}, not a file inside {root}: not read"
    return None


def _listed_files(output: str, key: str, folder: str, counts) -> tuple[list[str], list[str]]:
    """(paths, problems): the files OUTPUT/report.json lists under `key`, each checked for its size and
    SHA-256, and every file under OUTPUT/`folder` (hidden ones too) that `counts` but is not listed.
    A report that is not a JSON object, or lists malformed entries or names outside the folder, is a
    problem, never a crash."""
    report_path = os.path.join(output, "report.json")
    if not os.path.isfile(report_path):
        return [], [f"no {report_path}: the run did not finish, its output is incomplete"]
    try:
        with open(report_path, "rb") as handle:
            report = json.loads(handle.read().decode("utf-8"))
    except (OSError, ValueError) as error:
        return [], [f"{report_path} is not a readable report ({error})"]
    if not isinstance(report, dict):
        return [], [f"{report_path} is not a report (a JSON {type(report).__name__}, not an object)"]
    listed = report.get(key) or []
    root = os.path.join(output, folder)
    if not isinstance(listed, list):
        return [], [f"{report_path}: {key} is not a list"]
    problems = [p for p in (_entry_problem(entry, report_path, root) for entry in listed) if p]
    if problems:
        return [], problems
    found = set()
    for directory, _, names in os.walk(root):
        for name in names:
            relative = os.path.relpath(os.path.join(directory, name), root)
            if counts(relative):
                found.add(relative)
    problems = [
        f"{os.path.join(root, name)} is not a file the run wrote (not in {report_path})"
        for name in sorted(found - {entry["name"] for entry in listed})
    ]
    paths = []
    for entry in listed:
        path = os.path.join(root, entry["name"])
        if not os.path.isfile(path):
            problems.append(f"{path} is listed in {report_path} but missing")
            continue
        with open(path, "rb") as handle:
            digest = hashlib.sha256(handle.read()).hexdigest()
        if os.path.getsize(path) != entry["bytes"] or digest != entry["sha256"]:
            problems.append(f"{path} differs from the file the run wrote (size or SHA-256)")
        paths.append(path)
    if not listed:
        problems.append(f"{report_path} lists no {key}")
    return paths, problems


def verify_bound(
    input_path: str,
    output: str,
    max_contributions: int,
    capacities_path: str | None = None,
    id_column: str = "id",
    users_column: str = "users",
    users_columns: Iterable[str] = (),
    user_ids: str | None = None,
) -> dict:
    """Recompute every user's contribution from the input and OUTPUT/selected (users from `users_column`,
    or the union of `users_columns`, read as `user_ids` says); list violations."""
    users_from = _UsersFrom(users_column, users_columns, user_ids)
    shards, missing = _listed_files(output, "selection_files", "selected", lambda name: True)
    missing += [f"no input at {input_path}"] if not os.path.exists(input_path) else []
    if missing:
        return {"ok": False, "violation_count": len(missing), "violations": missing}
    violations: list[str] = _other_users_columns(output, users_from, "verify-bound")
    selected = _selection(output, shards, violations)

    users_of: dict = {}
    occurrences: Counter = Counter()
    suspects = _Suspects()
    for path in _input_files(input_path):
        for record_id, users in _readable_rows(path, id_column, users_from, violations, suspects):
            if record_id in selected:
                occurrences[record_id] += 1
                users_of[record_id] = set(users) if isinstance(users, list) else set()
    violations += suspects.violations()
    for record_id in selected:
        if occurrences[record_id] == 0:
            violations.append(f"selected id {record_id!r} is not in the input")
        elif occurrences[record_id] > 1:
            violations.append(f"selected id {record_id!r} appears {occurrences[record_id]} times in the input")

    contribution: defaultdict = defaultdict(int)
    for record_id, copies in selected.items():
        for user in users_of.get(record_id, ()):
            contribution[user] += copies
    try:
        capacity, text = _capacities(capacities_path)
    except (OSError, ValueError, KeyError, TypeError) as error:
        capacity, text = {}, False
        violations.append(f"{capacities_path}: not a readable capacities file ({type(error).__name__}: {error})")

    def bound_of(user) -> int:
        return capacity.get(str(user) if text else user, max_contributions)

    over = sorted(
        ((user, count, bound_of(user)) for user, count in contribution.items() if count > bound_of(user)),
        key=lambda v: (-v[1], str(v[0])),
    )
    violations += [f"user {user!r} contributes {count} records, bound {bound}" for user, count, bound in over]
    return {
        "ok": not violations,
        "selected_records": sum(selected.values()),
        "distinct_selected": len(selected),
        "users_with_selected_records": len(contribution),
        "max_user_contribution": max(contribution.values(), default=0),
        "users_over_bound": len(over),
        "violation_count": len(violations),
        "violations": violations[:_SHOWN],
    }


# --- batches ------------------------------------------------------------------------------------


def _example_class():
    """tf.train.Example built from its .proto description with the protobuf runtime: no TensorFlow."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    proto = descriptor_pb2.FileDescriptorProto(name="madp_verify_example.proto", package="madp_verify")
    label = descriptor_pb2.FieldDescriptorProto
    for name, kind in (
        ("BytesList", label.TYPE_BYTES),
        ("FloatList", label.TYPE_FLOAT),
        ("Int64List", label.TYPE_INT64),
    ):
        message = proto.message_type.add(name=name)
        message.field.add(name="value", number=1, type=kind, label=label.LABEL_REPEATED)
    feature = proto.message_type.add(name="Feature")
    feature.oneof_decl.add(name="kind")
    for number, name in ((1, "bytes_list"), (2, "float_list"), (3, "int64_list")):
        type_name = {"bytes_list": "BytesList", "float_list": "FloatList", "int64_list": "Int64List"}[name]
        feature.field.add(
            name=name,
            number=number,
            type=label.TYPE_MESSAGE,
            label=label.LABEL_OPTIONAL,
            type_name=f".madp_verify.{type_name}",
            oneof_index=0,
        )
    features = proto.message_type.add(name="Features")
    entry = features.nested_type.add(name="FeatureEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=label.TYPE_STRING, label=label.LABEL_OPTIONAL)
    entry.field.add(
        name="value", number=2, type=label.TYPE_MESSAGE, label=label.LABEL_OPTIONAL, type_name=".madp_verify.Feature"
    )
    features.field.add(
        name="feature",
        number=1,
        type=label.TYPE_MESSAGE,
        label=label.LABEL_REPEATED,
        type_name=".madp_verify.Features.FeatureEntry",
    )
    example = proto.message_type.add(name="Example")
    example.field.add(
        name="features",
        number=1,
        type=label.TYPE_MESSAGE,
        label=label.LABEL_OPTIONAL,
        type_name=".madp_verify.Features",
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("madp_verify.Example"))


def _masked_crc(data: bytes) -> int:
    import google_crc32c

    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def read_tfrecord(path: str):
    """Each record of a TFRecord file, checking both checksums."""
    import struct

    with open(path, "rb") as handle:
        data = handle.read()
    position = 0
    while position < len(data):
        if position + 12 > len(data):
            raise ValueError(f"{path}: truncated record header at byte {position}")
        header = data[position : position + 8]
        (length,) = struct.unpack("<Q", header)
        (length_crc,) = struct.unpack("<I", data[position + 8 : position + 12])
        payload = data[position + 12 : position + 12 + length]
        if length_crc != _masked_crc(header) or len(payload) != length:
            raise ValueError(f"{path}: corrupt record header at byte {position}")
        (payload_crc,) = struct.unpack("<I", data[position + 12 + length : position + 16 + length])
        if payload_crc != _masked_crc(payload):
            raise ValueError(f"{path}: corrupt record payload at byte {position}")
        yield payload
        position += 16 + length


def _feature_values(example, name: str) -> list:
    feature = example.features.feature[name]
    kind = feature.WhichOneof("kind")
    return list(getattr(feature, kind).value) if kind else []


# Each row's own features: (name, the kinds it may have), each holding exactly one value.
_ROW_FEATURES = (("step", ("int64_list",)), ("weight", ("float_list",)), ("id", ("int64_list", "bytes_list")))


def _row_fields(example, where: str) -> tuple[tuple | None, str | None]:
    """((step, weight, id), None) of a batch row, the id an int or text; or (None, the problem)."""
    values = {}
    for name, kinds in _ROW_FEATURES:
        if name not in example.features.feature:
            return None, f"{where}: no {name!r} feature"
        feature = example.features.feature[name]
        kind = feature.WhichOneof("kind")
        found = list(getattr(feature, kind).value) if kind else []
        if kind not in kinds or len(found) != 1:
            return None, f"{where}: feature {name!r} must hold one {' or '.join(kinds)} value, not {kind} {found[:3]}"
        values[name] = found[0]
    record_id = values["id"]
    if isinstance(record_id, bytes):
        try:
            record_id = record_id.decode("utf-8")
        except UnicodeDecodeError:
            return None, f"{where}: id {record_id[:40]!r} is not UTF-8 text"
    return (values["step"], values["weight"], record_id), None


def _batch_rows(files: list[str], violations: list[str]):
    """(where, step, weight, id) of every row of the batch files in order; a record that cannot be
    read or parsed, or lacks a row feature, is a violation naming its file and number."""
    from google.protobuf.message import DecodeError

    example_class = _example_class()
    for path in files:
        name, number = os.path.basename(path), -1
        try:
            for number, payload in enumerate(read_tfrecord(path)):
                where = f"{name} record {number}"
                try:
                    example = example_class.FromString(payload)
                except DecodeError as error:
                    violations.append(f"{where}: not a tf.train.Example ({error})")
                    continue
                fields, problem = _row_fields(example, where)
                if fields is None:
                    violations.append(str(problem))
                    continue
                yield (where, *fields)
        except ValueError as error:
            violations.append(f"{name}: unreadable after record {number}: {error}")


def _selection(selected: str, shards: list[str], violations: list[str]) -> dict:
    """{id: copies} of a bound output's selection `shards` (those its report lists: `_listed_files`);
    an unreadable shard, an id that is no string or 64-bit integer, a repeated id or copies that are not
    a positive integer (then counted as 0) is a violation."""
    copies_of: dict = {}
    for shard in shards:
        try:
            table = pq.read_table(shard, columns=["id", "copies"], page_checksum_verification=True)
            ids, all_copies = _column_values(table.column("id")), table.column("copies").to_pylist()
        except (OSError, ValueError, KeyError) as error:
            violations.append(f"{shard}: not a readable selection ({error})")
            continue
        for record_id, copies in zip(ids, all_copies):
            if not _scalar(record_id):  # a list, a null, or text that is not UTF-8
                violations.append(f"selected id {record_id!r} is not a string or a 64-bit integer")
                continue
            if record_id in copies_of:
                violations.append(f"id {record_id!r} is selected twice in {selected}/selected")
            if not isinstance(copies, int) or isinstance(copies, bool) or copies < 1:
                violations.append(f"id {record_id!r} has invalid copies {copies!r} in {selected}/selected")
                copies = 0
            copies_of[record_id] = copies
    return copies_of


def verify_batches(
    output: str,
    data_path: str,
    min_sep: int,
    max_participations: int | None = None,
    max_batch_size: int | None = None,
    id_column: str = "id",
    users_column: str = "users",
    *,
    selected: str,
    max_contributions: int,
    users_columns: Iterable[str] = (),
    user_ids: str | None = None,
) -> dict:
    """Re-read the batches, the records' users and the selection they were made from; list every
    violation: of the bound (a real row that is not a selected record of DATA, a record in more rows
    of a step than its copies, a user whose selected records in the batches have more than
    `max_contributions` copies in all), of min-sep, participations and sizes. Of OUTPUT/report.json
    only the list of batch files is read: the bound is re-derived, never taken from the batch report.
    A record's users are `users_column`'s list, or the union of `users_columns`, read as `user_ids` says."""
    users_from = _UsersFrom(users_column, users_columns, user_ids)
    files, problems = _listed_files(
        output, "files", "", lambda name: os.path.basename(name).startswith("batches-") and name.endswith(".tfrecord")
    )
    problems += [f"no records at {data_path}"] if not os.path.exists(data_path) else []
    shards, selection_problems = _listed_files(selected, "selection_files", "selected", lambda name: True)
    problems += selection_problems
    copies_of = _selection(selected, shards, problems)
    problems += _other_users_columns(selected, users_from, "verify-batches") if not selection_problems else []
    if problems:
        return {"ok": False, "violation_count": len(problems), "violations": problems}
    users_of: dict = {}
    occurrences: Counter = Counter()
    violations: list[str] = []
    suspects = _Suspects()
    for path in _input_files(data_path):
        for record_id, users in _readable_rows(path, id_column, users_from, violations, suspects):
            occurrences[record_id] += 1
            users_of[record_id] = set(users) if isinstance(users, list) else set()
    violations += suspects.violations()

    rows_per_step: Counter = Counter()
    rows_of_record_in_step: Counter = Counter()
    steps_of_user: defaultdict = defaultdict(list)
    batched: set = set()
    last_step, real_rows, padding_rows, unknown, unselected = -1, 0, 0, 0, 0
    for where, step, weight, record_id in _batch_rows(files, violations):
        if step < last_step:
            violations.append(f"{where}: step {step} after step {last_step}: not in step order")
        last_step = step
        rows_per_step[step] += 1
        if weight == 0.0:
            padding_rows += 1
            if record_id not in (-1, ""):  # a row of a record that trains with weight 0 is never written
                violations.append(f"{where}: step {step}: weight-0 row with id {record_id!r}, not padding's")
            continue
        if weight != 1.0:
            violations.append(f"{where}: step {step}: id {record_id!r} has weight {weight}, expected 1 or 0")
        real_rows += 1
        if record_id not in users_of:
            unknown += 1
            violations.append(f"{where}: step {step}: id {record_id!r} is not a record of {data_path}")
            continue
        if occurrences[record_id] > 1:
            violations.append(
                f"{where}: step {step}: id {record_id!r} appears {occurrences[record_id]} times in {data_path} "
                f"(no engine keeps a duplicated id)"
            )
        if record_id not in copies_of:
            unselected += 1
            violations.append(f"{where}: step {step}: id {record_id!r} is not a record {selected} selected")
        else:
            batched.add(record_id)
            rows_of_record_in_step[step, record_id] += 1
        for user in users_of[record_id]:
            steps_of_user[user].append(step)

    violations += [
        f"step {step}: record {record_id!r} is in {rows} rows, more than its {copies_of[record_id]} copies"
        for (step, record_id), rows in sorted(rows_of_record_in_step.items(), key=lambda v: (v[0][0], str(v[0][1])))
        if rows > copies_of[record_id]
    ]
    contribution: defaultdict = defaultdict(int)
    records_of_user: defaultdict = defaultdict(list)
    for record_id in batched:
        for user in users_of[record_id]:
            contribution[user] += copies_of[record_id]
            records_of_user[user].append(record_id)
    over = sorted(
        ((count, user) for user, count in contribution.items() if count > max_contributions),
        key=lambda v: (-v[0], str(v[1])),
    )
    violations += [
        f"user {user!r} has {count} records (copies counted) in the batches, over the contribution bound "
        f"{max_contributions}: records {sorted(records_of_user[user], key=str)[:10]}"
        for count, user in over
    ]

    closest: list[tuple[int, object, int, int]] = []
    too_many: list[tuple[int, object]] = []
    repeated_in_step = 0
    for user, steps in steps_of_user.items():
        distinct = sorted(set(steps))
        repeated_in_step += len(steps) - len(distinct)
        gaps = [(b - a, a, b) for a, b in zip(distinct, distinct[1:])]
        if gaps:
            gap, first, second = min(gaps)
            closest.append((gap, user, first, second))
        if max_participations is not None and len(distinct) > max_participations:
            too_many.append((len(distinct), user))
    closest.sort(key=lambda v: (v[0], str(v[1])))
    violations += [
        f"user {user!r} participates at steps {first} and {second}, {gap} apart (< min-sep {min_sep})"
        for gap, user, first, second in closest
        if gap < min_sep
    ]
    violations += [
        f"user {user!r} participates in {count} steps (> {max_participations})"
        for count, user in sorted(too_many, key=lambda v: (-v[0], str(v[1])))
    ]
    if max_batch_size is not None:
        violations += [
            f"step {step} has {rows} rows (> max batch size {max_batch_size})"
            for step, rows in sorted(rows_per_step.items())
            if rows > max_batch_size
        ]
    return {
        "ok": not violations,
        "files": len(files),
        "steps": len(rows_per_step),
        "rows": real_rows + padding_rows,
        "real_rows": real_rows,
        "padding_rows": padding_rows,
        "users": len(steps_of_user),
        "max_participations": max((len(set(s)) for s in steps_of_user.values()), default=0),
        "min_gap": closest[0][0] if closest else None,
        "user_rows_sharing_a_step": repeated_in_step,
        "unknown_ids": unknown,
        "unselected_rows": unselected,
        "contribution_bound": max_contributions,
        "max_user_contribution": max(contribution.values(), default=0),
        "users_over_bound": len(over),
        "violation_count": len(violations),
        "violations": violations[:_SHOWN],
    }
