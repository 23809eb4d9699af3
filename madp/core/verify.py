"""Independent checks of a bounding output (no user over its bound, no unknown selected id) and of
batches (re-derived from the records, the selection and the batch files: no user of the selection
over K, only selected records, within their copies; each row's content that of its record; the
rows the format says each file and step hold; min-sep between a user's participations,
participations, sizes).

Deliberately shares no code with the reader, the kernels, the engines or the batch writer: it
re-reads the input with plain pyarrow / json, the batches with protobuf, and counts contributions
with Python dictionaries. One file on purpose: it imports no other module of madp
(`tests/properties/test_import_graph.py` checks it), so it is the whole of what a reviewer reads to trust the
two verifiers.
"""

from __future__ import annotations

import csv
import dataclasses
import gzip
import hashlib
import json
import os
import re
import struct
import unicodedata
import zlib
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from email.utils import getaddresses
from typing import NamedTuple

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
    "not_a_plain_address": "an id holding '@' that is no plain lower-case address",
}
_ANGLE_ADDRESS = re.compile(r"<[^<>]*@[^<>]*>")
_UPPER = re.compile(r"[A-Z]")
# RFC 5322's atext but '|' and '+' (a subaddress follows it), and a domain's label (no '-' at either end),
# of ASCII letters `letters` (a plain address's are lower case), or with `letters` any printable non-ASCII
# character too (an address read under email); the local part neither begins nor ends with a quote
# (`_unquoted_ends`).
_ATOM = "[{letters}0-9!#$%&'*/=?^_`{{}}~-]+"
_LABEL = "[{letters}0-9]+(?:-+[{letters}0-9]+)*"
_ADDRESS = r"{atom}(?:\.{atom})*@{label}(?:\.{label})*"
_PLAIN = re.compile(_ADDRESS.format(atom=_ATOM.format(letters="a-z"), label=_LABEL.format(letters="a-z")))
_INTERNATIONAL = "a-z\u0080-\U0010ffff"
_READ = re.compile(
    _ADDRESS.format(atom=_ATOM.format(letters=_INTERNATIONAL), label=_LABEL.format(letters=_INTERNATIONAL))
)


def _signs_of(user: str) -> list[str]:
    """The signs a string user id shows: ',' or ';' with two '@' or more; an address in angle brackets;
    whitespace (str.isspace's) around it; one '@', no whitespace and an upper-case letter A-Z; an '@'
    in an id that shows none of those and is not a plain address (lower-case dot-atoms but '|' at a
    domain of lower-case labels)."""
    at_signs = user.count("@")
    shown = {
        "several_addresses": at_signs >= 2 and ("," in user or ";" in user),
        "display_name": bool(_ANGLE_ADDRESS.search(user)),
        "surrounding_whitespace": user != user.strip(),
        "upper_case": at_signs == 1 and not any(c.isspace() for c in user) and bool(_UPPER.search(user)),
    }
    plain = _PLAIN.fullmatch(user) and _unquoted_ends(user)
    shown["not_a_plain_address"] = at_signs > 0 and not any(shown.values()) and not plain
    return [sign for sign, found in shown.items() if found]


def _unquoted_ends(address: str) -> bool:
    """Whether the local part of an address neither begins nor ends with a quote ("'ann'@x" quotes ann@x)."""
    local = address.rpartition("@")[0]
    return not local.startswith("'") and not local.endswith("'")


# Unicode's Default_Ignorable_Code_Point ranges (DerivedCoreProperties.txt), as (first, last) code points
_IGNORABLE = (
    (0xAD, 0xAD), (0x34F, 0x34F), (0x61C, 0x61C), (0x115F, 0x1160), (0x17B4, 0x17B5), (0x180B, 0x180F),
    (0x200B, 0x200F), (0x202A, 0x202E), (0x2060, 0x206F), (0x3164, 0x3164), (0xFE00, 0xFE0F), (0xFEFF, 0xFEFF),
    (0xFFA0, 0xFFA0), (0xFFF0, 0xFFF8), (0x1BCA0, 0x1BCA3), (0x1D173, 0x1D17A), (0xE0000, 0xE0FFF),
)  # fmt: skip


def _shown(c: str) -> bool:
    """Whether a reader sees character `c`: not a format character (Cf) nor another default-ignorable one."""
    return unicodedata.category(c) != "Cf" and not any(first <= ord(c) <= last for first, last in _IGNORABLE)


def _addresses(user: str) -> list[str]:
    """The e-mail addresses a user value holds (--user-ids email), or none where one cannot be read: in
    the value's NFKC form, without invisible characters (Cf, and the other default-ignorable ones) and
    'mailto:' (any case), split at ';' and '|' (and at whitespace unless it holds one of <>()"),
    email.utils.getaddresses' addresses holding an '@', each stripped, lower-cased, unquoted ('"ann"@x'
    and "'ann'@x" are ann@x), without a subaddress (ann+news@x is ann@x) and without a final '.'; each
    must then be a plain address (non-ASCII letters allowed)."""
    text = "".join(c for c in unicodedata.normalize("NFKC", user) if _shown(c))
    text = re.sub("(?ai)mailto:", "", text)
    parts = re.split("[;|]", text)
    if not any(c in text for c in '<>()"'):
        parts = [word for part in parts for word in part.split()]
    read = []
    for _, found in getaddresses(parts):
        address = found.strip().lower()
        if "@" in address:
            local, _, domain = address.rpartition("@")
            if len(local) > 1 and local[0] == local[-1] and local[0] in "\"'" and local[0] not in local[1:-1]:
                local = local[1:-1]
            if "+" in local[1:] and "@" not in local:  # (an address of two '@' is none)
                local = local[: local.index("+", 1)]
            address = f"{local}@{domain[:-1] if domain.endswith('.') else domain}"
            if not (_READ.fullmatch(address) and _unquoted_ends(address) and address.isprintable()):
                return []
            read.append(address)
    return read


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
    """The rows of a JSON Lines file by the README's row rules, one at a time: a UTF-8 byte order mark
    only at byte 0 of the (gunzipped) file; a row ends at LF, a CR just before it dropped (a lone CR
    ends nothing); rows of only spaces, tabs and CRs skipped. An empty .gz is unreadable, not an empty
    file."""
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


def _report(output: str) -> tuple[dict, list[str]]:
    """OUTPUT/report.json as a JSON object, or {} and the problem: a missing report (an unfinished run),
    one that is not JSON or not an object is a problem, never a crash."""
    report_path = os.path.join(output, "report.json")
    if not os.path.isfile(report_path):
        return {}, [f"no {report_path}: the run did not finish, its output is incomplete"]
    try:
        with open(report_path, "rb") as handle:
            report = json.loads(handle.read().decode("utf-8"))
    except (OSError, ValueError) as error:
        return {}, [f"{report_path} is not a readable report ({error})"]
    if not isinstance(report, dict):
        return {}, [f"{report_path} is not a report (a JSON {type(report).__name__}, not an object)"]
    return report, []


def _listed_files(output: str, key: str, folder: str, counts) -> tuple[list[str], list[str]]:
    """(paths, problems): the files OUTPUT/report.json lists under `key`, each checked for its size and
    SHA-256, and every file under OUTPUT/`folder` (hidden ones too) that `counts` but is not listed.
    A report that is not a JSON object, or lists malformed entries or names outside the folder, is a
    problem, never a crash."""
    report_path = os.path.join(output, "report.json")
    report, problems = _report(output)
    if problems:
        return [], problems
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
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        if os.path.getsize(path) != entry["bytes"] or digest.hexdigest() != entry["sha256"]:
            problems.append(f"{path} differs from the file the run wrote (size or SHA-256)")
        paths.append(path)
    if not listed:
        problems.append(f"{report_path} lists no {key}")
    return paths, problems


def _selected_not_once(selected: dict, occurrences: Counter, data: str) -> list[str]:
    """A violation for each selected id that is not one valid record of `data`: no engine selects a record
    it did not read, nor keeps an id that two rows hold."""
    return [
        f"selected id {record_id!r} is not in {data}"
        if occurrences[record_id] == 0
        else f"selected id {record_id!r} appears {occurrences[record_id]} times in {data}"
        for record_id in selected
        if occurrences[record_id] != 1
    ]


def _contributions(selected: dict, users_of: dict) -> dict:
    """{user: copies of its selected records in all}, the users of each record as the records say."""
    contribution: defaultdict = defaultdict(int)
    for record_id, copies in selected.items():
        for user in users_of.get(record_id, ()):
            contribution[user] += copies
    return contribution


def _user_bounds(capacities_path: str | None, max_contributions: int, violations: list[str]):
    """Each user's bound: its capacity where the capacities file lists it, else `max_contributions`; an
    unreadable capacities file is a violation (and bounds every user by `max_contributions`)."""
    try:
        capacity, text = _capacities(capacities_path)
    except (OSError, ValueError, KeyError, TypeError) as error:
        capacity, text = {}, False
        violations.append(f"{capacities_path}: not a readable capacities file ({type(error).__name__}: {error})")

    def bound_of(user) -> int:
        return capacity.get(str(user) if text else user, max_contributions)

    return bound_of


def _over_bound(contribution: dict, bound_of) -> list[tuple]:
    """(user, contribution, bound) of every user over its bound, the largest contribution first."""
    return sorted(
        ((user, count, bound_of(user)) for user, count in contribution.items() if count > bound_of(user)),
        key=lambda v: (-v[1], str(v[0])),
    )


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
        for record_id, users, _ in _readable_rows(path, id_column, users_from, violations, suspects):
            if record_id in selected:
                occurrences[record_id] += 1
                users_of[record_id] = set(users)
    violations += suspects.violations()
    violations += _selected_not_once(selected, occurrences, "the input")
    contribution = _contributions(selected, users_of)
    bound_of = _user_bounds(capacities_path, max_contributions, violations)
    over = _over_bound(contribution, bound_of)
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
    """Each record of a TFRecord file, checking both checksums; read in 1 MiB blocks, so memory holds a
    record and a block. A file cut short (in a record's header, data or checksum) is a ValueError."""
    pending = bytearray()
    start = 0  # the byte of the file where `pending` starts
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            pending += block
            position = 0
            while len(pending) - position >= 12:
                header = bytes(pending[position : position + 8])
                (length,) = struct.unpack("<Q", header)
                (length_crc,) = struct.unpack("<I", pending[position + 8 : position + 12])
                if length_crc != _masked_crc(header):
                    raise ValueError(f"{path}: corrupt record header at byte {start + position}")
                end = position + 16 + length
                if end > len(pending):
                    break
                payload = bytes(pending[position + 12 : end - 4])
                (payload_crc,) = struct.unpack("<I", pending[end - 4 : end])
                if payload_crc != _masked_crc(payload):
                    raise ValueError(f"{path}: corrupt record payload at byte {start + position}")
                yield payload
                position = end
            del pending[:position]
            start += position
    if pending:
        raise ValueError(f"{path}: cut short in the record at byte {start} (only {len(pending)} bytes of it)")


def _feature_values(example, name: str) -> list:
    return list(_kind_and_values(example.features.feature[name])[1])


def _kind_and_values(feature) -> tuple[str | None, Sequence]:
    """A feature's kind and its values (protobuf's own sequence: not copied)."""
    kind = feature.WhichOneof("kind")
    return kind, getattr(feature, kind).value if kind else ()


# Each row's own features: (name, the kinds it may have), each holding exactly one value.
_ROW_FEATURES = (("step", ("int64_list",)), ("weight", ("float_list",)), ("id", ("int64_list", "bytes_list")))
_USER_FEATURE = "user"  # --sampler users: each row's user identity, by which training clips per user
_BATCH_FILE = re.compile(r"batches-(\d+)-of-(\d+)\.tfrecord")


def _row_fields(features: dict, where: str) -> tuple[tuple | None, str | None]:
    """((step, weight, id), None) of a batch row's {feature: (kind, values)}, the id an int or text; or
    (None, the problem)."""
    values = {}
    for name, kinds in _ROW_FEATURES:
        if name not in features:
            return None, f"{where}: no {name!r} feature"
        kind, found = features[name]
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


class _Layout(NamedTuple):
    """What the batch format says the files hold, whatever rows they hold: file i of n (its name,
    `batches-i-of-n.tfrecord`) holds steps ceil(i T / n) to ceil((i + 1) T / n) - 1 of the T steps
    training reads (the report's `steps`, as the trainer reads them), and padded batches (the report's
    `parameters.max_batch_size`, or any padding row) hold the same number of rows in every step."""

    files: list[tuple[str, range]]  # the files in step order, each with the steps it holds
    steps: int
    padded_to: int | None  # B_max of the report's parameters, where it says the steps are padded


def _batch_layout(paths: list[str], report: dict, output: str) -> tuple[_Layout | None, list[str]]:
    """The layout of the listed batch files, or the problems that leave it unknown: a name not of the
    format, files of several outputs or with some missing (a file left out of the listing), or no T."""
    report_path = os.path.join(output, "report.json")
    steps = _positive_int(report.get("steps"))
    problems = []
    if steps is None:
        problems.append(
            f"{report_path}: steps {report.get('steps')!r} is not a positive integer: which steps training reads is "
            f"unknown"
        )
    numbered: list[tuple[int, int, str]] = []
    for path in paths:
        match = _BATCH_FILE.fullmatch(os.path.basename(path))
        if match is None:
            problems.append(f"{path} is not named batches-NNNNN-of-MMMMM.tfrecord, as madp batch names its files")
        else:
            numbered.append((int(match[1]), int(match[2]), path))
    numbered.sort()
    counts = sorted({count for _, count, _ in numbered})
    if len(counts) > 1:
        problems.append(f"{output}: batch files of {counts} files each: the files of several batch outputs")
    elif counts and [number for number, _, _ in numbered] != list(range(counts[0])):
        problems.append(
            f"{output}: the batch files are numbers {[number for number, _, _ in numbered]} of {counts[0]}, not "
            f"each of 0..{counts[0] - 1} once: a batch file is missing from {report_path} or repeated"
        )
    if problems or steps is None:
        return None, problems
    files = [
        (path, range(-(-number * steps // count), -(-(number + 1) * steps // count)))
        for number, count, path in numbered
    ]
    parameters = report.get("parameters")
    return _Layout(
        files, steps, _positive_int(parameters.get("max_batch_size")) if isinstance(parameters, dict) else None
    ), []


def _positive_int(value) -> int | None:
    """`value` where it is an integer of at least 1 (not a boolean), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def _batch_rows(files: list[tuple[str, range]], violations: list[str]):
    """(where, the file's steps, step, weight, id, {feature: (kind, values)}) of every row of the batch
    files in order; a record that cannot be read or parsed, or lacks a row feature, is a violation
    naming its file and number."""
    from google.protobuf.message import DecodeError

    example_class = _example_class()
    for path, steps in files:
        name, number = os.path.basename(path), -1
        try:
            for number, payload in enumerate(read_tfrecord(path)):
                where = f"{name} record {number}"
                try:
                    example = example_class.FromString(payload)
                except DecodeError as error:
                    violations.append(f"{where}: not a tf.train.Example ({error})")
                    continue
                features = {name: _kind_and_values(feature) for name, feature in example.features.feature.items()}
                fields, problem = _row_fields(features, where)
                if fields is None:
                    violations.append(str(problem))
                    continue
                yield (where, steps, *fields, features)
        except ValueError as error:
            violations.append(f"{name}: unreadable after record {number}: {error}")


def _digest(values: Sequence, kind: str | None) -> bytes:
    """16 bytes of SHA-256 of a feature's values as a tf.train.Feature of `kind` holds them: int64s,
    float32s (a float rounded to float32, as madp batch writes it; an integer as a float), or UTF-8 text
    and bytes, each after its length; b"", which matches no feature, where no such feature can hold
    them (a null, a nested list, text in a number feature, a number beyond the kind's range)."""
    try:
        if kind == "int64_list":
            encoded = struct.pack(f"<{len(values)}q", *values)  # a boolean too: True is 1
        elif kind == "float_list":
            encoded = struct.pack(f"<{len(values)}f", *values)
        elif kind == "bytes_list":
            as_bytes = [value.encode("utf-8") if isinstance(value, str) else value for value in values]
            encoded = b"".join(struct.pack("<Q", len(value)) + value for value in as_bytes)
        else:
            return b""
    except (struct.error, OverflowError, TypeError):
        return b""
    return hashlib.sha256(encoded).digest()[:16]


def _values_of(value) -> list:
    """A content value of a DATA row as the values of its feature: a list's elements, or the value."""
    return value if isinstance(value, list) else [value]


@dataclasses.dataclass
class _Batched:
    """The batch files' rows as read. Memory: a step per real row and, per distinct (record, content)
    pair, a 16-byte digest of each content feature and the row that first holds it; no content itself."""

    content_names: tuple[str, ...] = ()  # the features a record's content gives (not step, id, weight, user)
    kinds: dict = dataclasses.field(default_factory=dict)  # feature -> kind, of the first row: every row's
    steps_of: dict = dataclasses.field(default_factory=lambda: defaultdict(list))  # id -> step of each real row
    first_row: dict = dataclasses.field(default_factory=dict)  # id -> (where, step) of its first real row
    content: dict = dataclasses.field(default_factory=lambda: defaultdict(dict))  # id -> {digests: [where, step, rows]}
    user_values: dict = dataclasses.field(default_factory=lambda: defaultdict(dict))  # id -> {user feature: where}
    rows_per_step: Counter = dataclasses.field(default_factory=Counter)
    real_rows: int = 0
    padding_rows: int = 0


def _read_batches(layout: _Layout, user_level: bool, violations: list[str]) -> _Batched:
    """Every row of the batch files, checked for what the format says of each (its file's steps, step
    order, weights, padding's id, the same features as every other row), the real ones kept by record."""
    batched = _Batched()
    last_step = -1
    for where, steps, step, weight, record_id, features in _batch_rows(layout.files, violations):
        kinds = {name: kind for name, (kind, _) in features.items()}
        if not batched.kinds:
            batched.kinds = kinds
            own = {name for name, _ in _ROW_FEATURES} | ({_USER_FEATURE} if user_level else set())
            batched.content_names = tuple(sorted(set(kinds) - own))
        elif kinds != batched.kinds:
            violations.append(
                f"{where}: features {sorted(kinds.items())}, not the first row's {sorted(batched.kinds.items())}"
            )
        if step not in steps:
            violations.append(
                f"{where}: step {step}, not one of the file's steps {steps.start}..{steps.stop - 1} (of {layout.steps})"
            )
        if step < last_step:
            violations.append(f"{where}: step {step} after step {last_step}: not in step order")
        last_step = step
        batched.rows_per_step[step] += 1
        if weight == 0.0:
            batched.padding_rows += 1
            if record_id not in (-1, ""):  # a row of a record that trains with weight 0 is never written
                violations.append(f"{where}: step {step}: weight-0 row with id {record_id!r}, not padding's")
            continue
        if weight != 1.0:
            violations.append(f"{where}: step {step}: id {record_id!r} has weight {weight}, expected 1 or 0")
        batched.real_rows += 1
        batched.steps_of[record_id].append(step)
        batched.first_row.setdefault(record_id, (where, step))
        digests = tuple(
            _digest(features[name][1], kinds[name]) if name in kinds else b"" for name in batched.content_names
        )
        batched.content[record_id].setdefault(digests, [where, step, 0])[2] += 1
        if user_level and _USER_FEATURE in kinds:
            batched.user_values[record_id].setdefault(tuple(features[_USER_FEATURE][1]), where)
    if user_level and batched.kinds and _USER_FEATURE not in batched.kinds:
        violations.append(f"the rows have no {_USER_FEATURE!r} feature, by which user-level training clips per user")
    return batched


def _other_content(record_id, values: tuple, batched: _Batched, data_path: str) -> list[tuple[str, int]]:
    """(violation, rows) for each content of `record_id`'s rows that is not the content DATA's record
    gives (`values`, of `batched.content_names`), naming the features that differ."""
    expected = [_digest(_values_of(value), batched.kinds[name]) for name, value in zip(batched.content_names, values)]
    found = []
    for digests, (where, step, rows) in batched.content[record_id].items():
        differ = [
            name for name, held, wanted in zip(batched.content_names, digests, expected) if not wanted or held != wanted
        ]
        if differ:
            more = f" ({rows} rows)" if rows > 1 else ""
            found.append(
                (f"{where}: step {step}: id {record_id!r}: {differ} differ from its record in {data_path}{more}", rows)
            )
    return found


def _user_identity_problems(user_values: dict, users_of: dict) -> list[str]:
    """User-level batches: per-user clipping groups a step's rows by their `user` feature, so each
    record must have one user (in DATA) and the feature must name users one to one."""
    problems = []
    value_of_user: dict = {}
    user_of_value: dict = {}
    for record_id, values in user_values.items():
        users = users_of.get(record_id)
        if users is None:
            continue  # not a record of DATA: a violation of its own
        if len(users) != 1:
            problems.append(f"record {record_id!r} has {len(users)} users in the records: user-level rows need one")
            continue
        (user,) = users
        for value, where in values.items():
            if value_of_user.setdefault(user, value) != value:
                problems.append(
                    f"{where}: user {user!r} has {_USER_FEATURE} {list(value)}, elsewhere {list(value_of_user[user])}: "
                    f"per-user clipping would split the user"
                )
            if user_of_value.setdefault(value, user) != user:
                problems.append(
                    f"{where}: {_USER_FEATURE} {list(value)} is user {user!r} here, {user_of_value[value]!r} elsewhere:"
                    f" per-user clipping would merge them"
                )
    return problems


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
    capacities_path: str | None = None,
) -> dict:
    """Re-read the batches, the records and the selection they were made from; list every violation:
    of the bound (a user whose selected records have more than `max_contributions` copies in all, or
    more than its capacity in `capacities_path`, whatever the batches sampled; a real row that is not a
    selected record of DATA, or a record in more rows of a step than its copies), of content (a real
    row whose features are not those DATA's record gives; user-level rows whose `user` feature is not
    their one user's, one to one), of the format (a file's rows outside its steps or out of order, a
    step of padded batches without its B_max rows: a file cut short), of min-sep, participations and
    sizes. Of OUTPUT/report.json only what the trainer reads to read the files is used: the list of
    batch files, T (`steps`), `parameters.max_batch_size` and whether the sampler is `users`; the bound
    is re-derived, never taken from the batch report. A record's users are `users_column`'s list, or
    the union of `users_columns`, read as `user_ids` says.

    Memory: the selection's ids, the users of the selected and batched records, a step per real row, and
    16 bytes per content feature of each distinct batched (record, content); DATA and the batch files
    are streamed (a Parquet batch of rows, a line, a TFRecord and a 1 MiB block at a time)."""
    users_from = _UsersFrom(users_column, users_columns, user_ids)
    files, problems = _listed_files(
        output, "files", "", lambda name: os.path.basename(name).startswith("batches-") and name.endswith(".tfrecord")
    )
    report, _ = _report(output)
    layout, layout_problems = _batch_layout(files, report, output) if not problems else (None, [])
    problems += layout_problems
    problems += [f"no records at {data_path}"] if not os.path.exists(data_path) else []
    shards, selection_problems = _listed_files(selected, "selection_files", "selected", lambda name: True)
    problems += selection_problems
    copies_of = _selection(selected, shards, problems)
    problems += _other_users_columns(selected, users_from, "verify-batches") if not selection_problems else []
    if problems or layout is None:
        return {"ok": False, "violation_count": len(problems), "violations": problems}
    violations: list[str] = []
    batched = _read_batches(layout, report.get("sampler") == "users", violations)
    padded_to = layout.padded_to or (max(batched.rows_per_step.values()) if batched.padding_rows else None)
    if padded_to is not None:
        violations += [
            f"step {step} holds {batched.rows_per_step[step]} rows, not the {padded_to} every step of padded "
            f"batches holds: rows are missing (a batch file cut short?) or added"
            for step in range(layout.steps)
            if batched.rows_per_step[step] != padded_to
        ]

    # DATA, streamed: the users of the selected and batched records, and the content of the batched.
    users_of: dict = {}
    occurrences: Counter = Counter()
    other_content = []
    suspects = _Suspects()
    for path in _input_files(data_path):
        for record_id, users, values in _readable_rows(
            path, id_column, users_from, violations, suspects, batched.content_names
        ):
            if record_id in copies_of or record_id in batched.steps_of:
                occurrences[record_id] += 1
                users_of[record_id] = set(users)
                if occurrences[record_id] == 1 and record_id in batched.content:
                    other_content += _other_content(record_id, values, batched, data_path)
    violations += suspects.violations()
    violations += [violation for violation, _ in other_content]

    rows_of_record_in_step: Counter = Counter()
    steps_of_user: defaultdict = defaultdict(list)
    unknown = unselected = 0
    for record_id, steps in batched.steps_of.items():
        where, step = batched.first_row[record_id]
        more = f" ({len(steps)} rows)" if len(steps) > 1 else ""
        if record_id not in users_of:
            unknown += len(steps)
            violations.append(f"{where}: step {step}: id {record_id!r} is not a record of {data_path}{more}")
            continue
        if occurrences[record_id] > 1:
            violations.append(
                f"{where}: step {step}: id {record_id!r} appears {occurrences[record_id]} times in {data_path} "
                f"(no engine keeps a duplicated id)"
            )
        if record_id not in copies_of:
            unselected += len(steps)
            violations.append(f"{where}: step {step}: id {record_id!r} is not a record {selected} selected{more}")
        else:
            rows_of_record_in_step.update((step, record_id) for step in steps)
        for user in users_of[record_id]:
            steps_of_user[user].extend(steps)
    violations += [
        f"step {step}: record {record_id!r} is in {rows} rows, more than its {copies_of[record_id]} copies"
        for (step, record_id), rows in sorted(rows_of_record_in_step.items(), key=lambda v: (v[0][0], str(v[0][1])))
        if rows > copies_of[record_id]
    ]
    violations += _user_identity_problems(batched.user_values, users_of)

    # The bound over the whole selection, whatever the batches sampled of it.
    violations += _selected_not_once(copies_of, occurrences, data_path)
    contribution = _contributions(copies_of, users_of)
    over = _over_bound(contribution, _user_bounds(capacities_path, max_contributions, violations))
    over_users = {user for user, _, _ in over}
    records_of_user: defaultdict = defaultdict(list)
    for record_id in copies_of:
        for user in users_of.get(record_id, set()) & over_users:
            records_of_user[user].append(record_id)
    violations += [
        f"user {user!r} has {count} records (copies counted) in the selection, over "
        f"{f'the contribution bound {bound}' if bound == max_contributions else f'its capacity {bound}'}: "
        f"records {sorted(records_of_user[user], key=str)[:10]}"
        for user, count, bound in over
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
            for step, rows in sorted(batched.rows_per_step.items())
            if rows > max_batch_size
        ]
    return {
        "ok": not violations,
        "files": len(files),
        "steps": len(batched.rows_per_step),
        "rows": batched.real_rows + batched.padding_rows,
        "real_rows": batched.real_rows,
        "padding_rows": batched.padding_rows,
        "users": len(steps_of_user),
        "max_participations": max((len(set(s)) for s in steps_of_user.values()), default=0),
        "min_gap": closest[0][0] if closest else None,
        "user_rows_sharing_a_step": repeated_in_step,
        "unknown_ids": unknown,
        "unselected_rows": unselected,
        "content_features": list(batched.content_names),
        "rows_with_other_content": sum(rows for _, rows in other_content),
        "contribution_bound": max_contributions,
        "max_user_contribution": max(contribution.values(), default=0),
        "users_over_bound": len(over),
        "violation_count": len(violations),
        "violations": violations[:_SHOWN],
    }
