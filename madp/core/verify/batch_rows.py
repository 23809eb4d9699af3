"""The rows of batch files checked by what the batch format says of each: the steps each file holds,
step order, weights, padding, the same features in every row; and what the rows say of their records
(the digests of their content, their `user` feature) for `verify_batches` to check against DATA."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import struct
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import NamedTuple

from madp.core.verify.tfrecords import _example_class, _kind_and_values, read_tfrecord

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
