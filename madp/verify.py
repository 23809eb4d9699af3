"""Independent check of a bounding output: no user over its bound, no unknown selected id.

Deliberately shares no code with the reader, the kernels or the engines: it re-reads the input
with plain pyarrow / json, and counts contributions with Python dictionaries.
"""
from __future__ import annotations

import csv
import glob
import json
import os
from collections import Counter, defaultdict

import pyarrow.parquet as pq

_SHOWN = 20


def _input_files(path: str) -> list[str]:
    if os.path.isdir(path):
        return sorted(f for f in glob.glob(os.path.join(path, "**", "*"), recursive=True)
                      if f.endswith((".jsonl", ".parquet")) and not os.path.basename(f).startswith((".", "_")))
    return [path]


def _rows(path: str, id_column: str, users_column: str):
    """(id, users) of every row that has both, as read from disk."""
    if path.endswith(".parquet"):
        table = pq.read_table(path, columns=[id_column, users_column])
        yield from zip(table.column(id_column).to_pylist(), table.column(users_column).to_pylist())
        return
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if isinstance(row, dict):
                    yield row.get(id_column), row.get(users_column)


def _capacities(path: str | None) -> dict:
    if path is None:
        return {}
    if path.endswith(".parquet"):
        table = pq.read_table(path)
        return dict(zip(table.column("user").to_pylist(), table.column("capacity").to_pylist()))
    if path.endswith(".csv"):
        with open(path, newline="", encoding="utf-8") as handle:
            rows = list(csv.DictReader(handle))
        return {_number_or_text(r["user"]): int(r["capacity"]) for r in rows}
    with open(path, encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    return {r["user"]: r["capacity"] for r in rows}


def _number_or_text(value: str):
    try:
        return int(value)
    except ValueError:
        return value


def verify_bound(input_path: str, output: str, max_contributions: int, capacities_path: str | None = None,
                 id_column: str = "id", users_column: str = "users") -> dict:
    """Recompute every user's contribution from the input and OUTPUT/selected; list violations."""
    shards = sorted(glob.glob(os.path.join(output, "selected", "*.parquet")))
    missing = [f"no selection: {output}/selected/*.parquet not found"] if not shards else []
    missing += [f"no input at {input_path}"] if not os.path.exists(input_path) else []
    if missing:
        return {"ok": False, "violation_count": len(missing), "violations": missing}
    selected: dict = {}
    violations: list[str] = []
    for shard in shards:
        table = pq.read_table(shard)
        for record_id, copies in zip(table.column("id").to_pylist(), table.column("copies").to_pylist()):
            if record_id in selected:
                violations.append(f"id {record_id!r} is selected twice in {output}/selected")
            if not isinstance(copies, int) or copies < 1:
                violations.append(f"id {record_id!r} has invalid copies {copies!r}")
            selected[record_id] = copies

    users_of: dict = {}
    occurrences: Counter = Counter()
    for path in _input_files(input_path):
        for record_id, users in _rows(path, id_column, users_column):
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
    capacity = _capacities(capacities_path)
    # A CSV cannot say whether user "123" is a number: match capacities by text as well as by value.
    capacity_by_text = {str(user): bound for user, bound in capacity.items()}

    def bound_of(user) -> int:
        return capacity.get(user, capacity_by_text.get(str(user), max_contributions))

    over = sorted(((user, count, bound_of(user)) for user, count in contribution.items() if count > bound_of(user)),
                  key=lambda v: (-v[1], str(v[0])))
    violations += [f"user {user!r} contributes {count} records, bound {bound}" for user, count, bound in over]
    return {"ok": not violations, "selected_records": sum(c for c in selected.values() if isinstance(c, int)),
            "distinct_selected": len(selected), "users_with_selected_records": len(contribution),
            "max_user_contribution": max(contribution.values(), default=0),
            "users_over_bound": len(over), "violation_count": len(violations), "violations": violations[:_SHOWN]}
