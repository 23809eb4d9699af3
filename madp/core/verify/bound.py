"""`madp verify-bound`, and the bound over a selection both verifiers re-derive from the records: each
user's copies of its selected records against its capacity or the contribution bound."""

from __future__ import annotations

import csv
import json
import os
import tempfile
from collections import Counter, defaultdict
from collections.abc import Container, Iterable
from typing import NamedTuple

import pyarrow.parquet as pq

from madp.core.verify.buckets import _bucket_count, _Buckets
from madp.core.verify.outputs import _copies_of, _in_order, _listed_files, _other_users_columns, _selection_entries
from madp.core.verify.records import _input_files, _json_lines, _readable_rows, _UsersFrom
from madp.core.verify.user_ids import _Suspects

_SHOWN = 20  # the violations a verifier lists (it counts them all)


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


def _selected_not_once(selected: Iterable, occurrences: Counter, data: str) -> list[tuple[object, str]]:
    """(id, violation) for each selected id that is not one valid record of `data`: no engine selects a
    record it did not read, nor keeps an id that two rows hold."""
    return [
        (
            record_id,
            f"selected id {record_id!r} is not in {data}"
            if occurrences[record_id] == 0
            else f"selected id {record_id!r} appears {occurrences[record_id]} times in {data}",
        )
        for record_id in selected
        if occurrences[record_id] != 1
    ]


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


class _BucketedSelection(NamedTuple):
    """The selection joined with the records a bucket of ids at a time: its totals, the violations of ids
    that are not one record (by the position of their first entry), each user's (user, copies, id) of the
    selected records it is in, in `contributions`' buckets by user, and the copies of the selected ids among
    those asked for (`_join_selection`'s `kept`)."""

    selected_records: int
    distinct_selected: int
    not_once: list[tuple[int, str]]
    contributions: _Buckets
    kept_copies: dict


def _join_selection(
    selection: _Buckets, rows: _Buckets, selected: str, data: str, problems: list, kept: Container = ()
) -> _BucketedSelection:
    """The selection's entries (`selection`, bucketed by id) joined with the records' (id, users) (`rows`, the
    same buckets), one bucket in memory at a time; an id selected twice a problem (`_copies_of`)."""
    contributions = _Buckets(selection.count, os.path.dirname(selection.paths[0]), "contributions")
    selected_records = distinct = 0
    not_once: list[tuple[int, str]] = []
    kept_copies: dict = {}
    for bucket in range(selection.count):
        copies_of, first = _copies_of(selection.items(bucket), selected, problems)
        occurrences: Counter = Counter()
        users_of: dict = {}
        for record_id, users in rows.items(bucket):
            if record_id in copies_of:
                occurrences[record_id] += 1
                users_of[record_id] = set(users)
        not_once += [(first[record_id], v) for record_id, v in _selected_not_once(copies_of, occurrences, data)]
        for record_id, copies in copies_of.items():
            for user in users_of.get(record_id, ()):
                contributions.put(user, (user, copies, record_id))
            if record_id in kept:
                kept_copies[record_id] = copies
        selected_records += sum(copies_of.values())
        distinct += len(copies_of)
    return _BucketedSelection(selected_records, distinct, not_once, contributions, kept_copies)


class _UserTotals(NamedTuple):
    """Of the users of the selected records: how many, the largest contribution, and (user, contribution,
    bound) of each over its bound, the largest contribution first."""

    users: int
    most: int
    over: list[tuple]


def _user_totals(contributions: _Buckets, bound_of) -> _UserTotals:
    """Each user's contribution (`_join_selection`'s buckets by user), a bucket of users at a time."""
    users = most = 0
    over: list[tuple] = []
    for bucket in range(contributions.count):
        contribution: defaultdict = defaultdict(int)
        for user, copies, _ in contributions.items(bucket):
            contribution[user] += copies
        users += len(contribution)
        most = max(most, max(contribution.values(), default=0))
        over += _over_bound(contribution, bound_of)
    over.sort(key=lambda v: (-v[1], str(v[0])))
    return _UserTotals(users, most, over)


def verify_bound(
    input_path: str,
    output: str,
    max_contributions: int,
    capacities_path: str | None = None,
    id_column: str = "id",
    users_column: str = "users",
    users_columns: Iterable[str] = (),
    user_ids: str | None = None,
    buckets: int | None = None,
) -> dict:
    """Recompute every user's contribution from the input and OUTPUT/selected (users from `users_column`,
    or the union of `users_columns`, read as `user_ids` says); list violations.

    Memory: one bucket of `buckets` (by default one per 128 MiB of input), on disk under a temporary
    folder: the selection and the records by a hash of their id, then each user's copies by a hash of the
    user; the capacities and the violations."""
    users_from = _UsersFrom(users_column, users_columns, user_ids)
    shards, missing = _listed_files(output, "selection_files", "selected", lambda name: True)
    missing += [f"no input at {input_path}"] if not os.path.exists(input_path) else []
    if missing:
        return {"ok": False, "violation_count": len(missing), "violations": missing}
    violations: list[str] = _other_users_columns(output, users_from, "verify-bound")
    files = _input_files(input_path)
    with tempfile.TemporaryDirectory(prefix="madp-verify-bound-") as folder:
        bucket_count = _bucket_count(files, buckets)
        selection, rows = _Buckets(bucket_count, folder, "selected"), _Buckets(bucket_count, folder, "rows")
        problems: list[tuple[int, int, str]] = []
        for entry in _selection_entries(output, shards, problems):
            selection.put(entry[1], entry)
        read_problems: list[str] = []
        suspects = _Suspects()
        for path in files:
            for record_id, users, _ in _readable_rows(path, id_column, users_from, read_problems, suspects):
                rows.put(record_id, (record_id, users))
        joined = _join_selection(selection, rows, output, "the input", problems)
        capacity_problems: list[str] = []
        totals = _user_totals(joined.contributions, _user_bounds(capacities_path, max_contributions, capacity_problems))
    violations += _in_order(problems) + read_problems + suspects.violations() + _in_order(joined.not_once)
    violations += capacity_problems
    violations += [f"user {user!r} contributes {count} records, bound {bound}" for user, count, bound in totals.over]
    return {
        "ok": not violations,
        "selected_records": joined.selected_records,
        "distinct_selected": joined.distinct_selected,
        "users_with_selected_records": totals.users,
        "max_user_contribution": totals.most,
        "users_over_bound": len(totals.over),
        "violation_count": len(violations),
        "violations": violations[:_SHOWN],
    }
