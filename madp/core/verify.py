"""Independent checks of a bounding output (no user over its bound, no unknown selected id) and of
batches (min-sep between a user's participations, participations, sizes).

Deliberately shares no code with the reader, the kernels or the engines: it re-reads the input
with plain pyarrow / json, and counts contributions with Python dictionaries. One file over
~350 lines on purpose: it imports no other module of madp (`tests/test_import_graph.py` checks
it), so it is the whole of what a reviewer reads to trust the two verifiers.
"""

from __future__ import annotations

import csv
import glob
import gzip
import hashlib
import json
import os
from collections import Counter, defaultdict
from collections.abc import Iterable

import pyarrow.parquet as pq

_SHOWN = 20


def _input_files(path: str) -> list[str]:
    if os.path.isdir(path):
        return sorted(
            f
            for f in glob.glob(os.path.join(path, "**", "*"), recursive=True)
            if f.endswith((".jsonl", ".jsonl.gz", ".parquet")) and not os.path.basename(f).startswith((".", "_"))
        )
    return [path]


def _scalar(value) -> bool:
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


def _rows(path: str, id_column: str, users_column: str):
    """(id, users) of every row with a scalar id and a list of scalar users, as read from disk; other
    rows (undecodable, not JSON objects, list ids, nested users) are invalid and no engine keeps them."""
    pairs: Iterable[tuple[object, object]]
    if path.endswith(".parquet"):
        table = pq.read_table(path, columns=[id_column, users_column], page_checksum_verification=True)
        pairs = zip(table.column(id_column).to_pylist(), table.column(users_column).to_pylist())
    else:
        pairs = (_json_pair(line, id_column, users_column) for line in _json_lines(path))
    for record_id, users in pairs:
        if _scalar(record_id) and isinstance(users, list) and all(_scalar(u) for u in users):
            yield record_id, users


def _readable_rows(path: str, id_column: str, users_column: str, violations: list[str]) -> list:
    """`_rows` of a file, or none and a violation when the file cannot be read at all."""
    try:
        return list(_rows(path, id_column, users_column))
    except (OSError, ValueError, KeyError) as error:
        violations.append(f"{path}: cannot be read ({error})")
        return []


def _json_lines(path: str):
    """The non-blank lines of a JSON Lines file as bytes, without a leading UTF-8 byte order mark."""
    with (gzip.open if path.endswith(".gz") else open)(path, "rb") as handle:
        data = handle.read()
    data = data[3:] if data.startswith(b"\xef\xbb\xbf") else data
    return [line for line in data.split(b"\n") if line.strip()]


def _json_pair(line: bytes, id_column: str, users_column: str):
    try:
        row = json.loads(line.decode("utf-8"))
    except ValueError:  # invalid UTF-8 or JSON
        return None, None
    return (row.get(id_column), row.get(users_column)) if isinstance(row, dict) else (None, None)


def _capacities(path: str | None) -> tuple[dict, bool]:
    """({user: capacity}, whether the users are text): a CSV's user ids are text, matched to the exact
    text of an input user id; JSON Lines and Parquet ids are typed, matched by type and value."""
    if path is None:
        return {}, False
    if path.endswith(".parquet"):
        table = pq.read_table(path, page_checksum_verification=True)
        return dict(zip(table.column("user").to_pylist(), table.column("capacity").to_pylist())), False
    if path.endswith(".csv"):
        with open(path, newline="", encoding="utf-8") as handle:
            return {r["user"]: int(r["capacity"]) for r in csv.DictReader(handle)}, True
    with open(path, encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    return {r["user"]: r["capacity"] for r in rows}, False


def _listed_files(output: str, key: str, folder: str, counts) -> tuple[list[str], list[str]]:
    """(paths, problems): the files OUTPUT/report.json lists under `key`, each checked for its size and
    SHA-256, and every file under OUTPUT/`folder` (hidden ones too) that `counts` but is not listed."""
    report_path = os.path.join(output, "report.json")
    if not os.path.isfile(report_path):
        return [], [f"no {report_path}: the run did not finish, its output is incomplete"]
    with open(report_path, encoding="utf-8") as handle:
        listed = json.load(handle).get(key) or []
    root = os.path.join(output, folder)
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
) -> dict:
    """Recompute every user's contribution from the input and OUTPUT/selected; list violations."""
    shards, missing = _listed_files(output, "selection_files", "selected", lambda name: True)
    missing += [f"no input at {input_path}"] if not os.path.exists(input_path) else []
    if missing:
        return {"ok": False, "violation_count": len(missing), "violations": missing}
    selected: dict = {}
    violations: list[str] = []
    for shard in shards:
        table = pq.read_table(shard, page_checksum_verification=True)
        for record_id, copies in zip(table.column("id").to_pylist(), table.column("copies").to_pylist()):
            if record_id in selected:
                violations.append(f"id {record_id!r} is selected twice in {output}/selected")
            if not isinstance(copies, int) or copies < 1:
                violations.append(f"id {record_id!r} has invalid copies {copies!r}")
            selected[record_id] = copies

    users_of: dict = {}
    occurrences: Counter = Counter()
    for path in _input_files(input_path):
        for record_id, users in _readable_rows(path, id_column, users_column, violations):
            if record_id in selected:
                occurrences[record_id] += 1
                users_of[record_id] = set(users) if isinstance(users, list) else set()
    for record_id in selected:
        if occurrences[record_id] == 0:
            violations.append(f"selected id {record_id!r} is not in the input")
        elif occurrences[record_id] > 1:
            violations.append(f"selected id {record_id!r} appears {occurrences[record_id]} times in the input")

    contribution: defaultdict = defaultdict(int)
    for record_id, copies in selected.items():
        for user in users_of.get(record_id, ()):
            contribution[user] += copies if isinstance(copies, int) else 0
    capacity, text = _capacities(capacities_path)

    def bound_of(user) -> int:
        return capacity.get(str(user) if text else user, max_contributions)

    over = sorted(
        ((user, count, bound_of(user)) for user, count in contribution.items() if count > bound_of(user)),
        key=lambda v: (-v[1], str(v[0])),
    )
    violations += [f"user {user!r} contributes {count} records, bound {bound}" for user, count, bound in over]
    return {
        "ok": not violations,
        "selected_records": sum(c for c in selected.values() if isinstance(c, int)),
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


def verify_batches(
    output: str,
    data_path: str,
    min_sep: int,
    max_participations: int | None = None,
    max_batch_size: int | None = None,
    id_column: str = "id",
    users_column: str = "users",
) -> dict:
    """Re-read the batches and the records' users; list every min-sep, participation and size violation."""
    files, problems = _listed_files(
        output, "files", "", lambda name: os.path.basename(name).startswith("batches-") and name.endswith(".tfrecord")
    )
    problems += [f"no records at {data_path}"] if not os.path.exists(data_path) else []
    if problems:
        return {"ok": False, "violation_count": len(problems), "violations": problems}
    users_of: dict = {}
    violations: list[str] = []
    for path in _input_files(data_path):
        for record_id, users in _readable_rows(path, id_column, users_column, violations):
            users_of[str(record_id)] = set(users) if isinstance(users, list) else set()

    example_class = _example_class()
    rows_per_step: Counter = Counter()
    steps_of_user: defaultdict = defaultdict(list)
    last_step, real_rows, padding_rows, unknown = -1, 0, 0, 0
    for path in files:
        for payload in read_tfrecord(path):
            example = example_class.FromString(payload)
            step = _feature_values(example, "step")[0]
            weight = _feature_values(example, "weight")[0]
            raw_id = _feature_values(example, "id")[0]
            record_id = raw_id.decode() if isinstance(raw_id, bytes) else str(raw_id)
            if step < last_step:
                violations.append(f"{os.path.basename(path)}: step {step} after step {last_step}: not in step order")
            last_step = step
            rows_per_step[step] += 1
            if weight == 0.0:
                padding_rows += 1
                continue
            if weight != 1.0:
                violations.append(f"step {step}: id {record_id} has weight {weight}, expected 1 or 0")
            real_rows += 1
            if record_id not in users_of:
                unknown += 1
                violations.append(f"step {step}: id {record_id} is not a record of {data_path}")
                continue
            for user in users_of[record_id]:
                steps_of_user[user].append(step)

    closest: list[tuple[int, object, int, int]] = []
    over: list[tuple[int, object]] = []
    repeated_in_step = 0
    for user, steps in steps_of_user.items():
        distinct = sorted(set(steps))
        repeated_in_step += len(steps) - len(distinct)
        gaps = [(b - a, a, b) for a, b in zip(distinct, distinct[1:])]
        if gaps:
            gap, first, second = min(gaps)
            closest.append((gap, user, first, second))
        if max_participations is not None and len(distinct) > max_participations:
            over.append((len(distinct), user))
    closest.sort(key=lambda v: (v[0], str(v[1])))
    violations += [
        f"user {user!r} participates at steps {first} and {second}, {gap} apart (< min-sep {min_sep})"
        for gap, user, first, second in closest
        if gap < min_sep
    ]
    violations += [
        f"user {user!r} participates in {count} steps (> {max_participations})"
        for count, user in sorted(over, key=lambda v: (-v[0], str(v[1])))
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
        "violation_count": len(violations),
        "violations": violations[:_SHOWN],
    }
