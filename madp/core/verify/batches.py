"""`madp verify-batches`: the batches re-read with the records and the selection they were made from."""

from __future__ import annotations

import os
import tempfile
from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import NamedTuple

from madp.core.verify.batch_rows import (
    _batch_layout,
    _Batched,
    _Layout,
    _other_content,
    _read_batches,
    _user_identity_problems,
)
from madp.core.verify.bound import _SHOWN, _join_selection, _user_bounds, _user_totals
from madp.core.verify.buckets import _bucket_count, _Buckets
from madp.core.verify.outputs import (
    _copies_of,
    _in_order,
    _listed_files,
    _other_users_columns,
    _report,
    _selection_entries,
)
from madp.core.verify.records import _input_files, _readable_rows, _UsersFrom
from madp.core.verify.user_ids import _Suspects


class _Inputs(NamedTuple):
    """What verify-batches reads before the rows: the listed batch files, their report and layout, and the
    selection's entries in buckets by id."""

    files: list[str]
    report: dict
    layout: _Layout | None
    selection: _Buckets


class _Records(NamedTuple):
    """DATA as the verifier reads it for the batched records: each one's users, the rows that hold its id,
    and (violation, rows) for each batched content that is not its record's; every record's (id, users) in
    buckets by id, for the bound over the selection."""

    users_of: dict
    occurrences: Counter
    other_content: list[tuple[str, int]]
    rows: _Buckets


class _Placed(NamedTuple):
    """Where the batched records' rows are: each user's steps, and the rows of ids DATA lacks (`unknown`)
    or the selection lacks (`unselected`)."""

    steps_of_user: dict
    unknown: int
    unselected: int


class _Participations(NamedTuple):
    """Each user's closest two participations (gap, user, first step, second step), closest first, and the
    rows of a user that share a step with another of its rows."""

    closest: list[tuple[int, object, int, int]]
    repeated_in_step: int


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
    buckets: int | None = None,
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

    Memory: the users of the batched records, a step per real row, and 16 bytes per content feature of
    each distinct batched (record, content); of the selection and DATA's records, one bucket of `buckets`
    (by default one per 128 MiB of DATA) on disk under a temporary folder, as verify-bound holds them; DATA
    and the batch files are streamed (a Parquet batch of rows, a line, a TFRecord and a 1 MiB block at a
    time)."""
    users_from = _UsersFrom(users_column, users_columns, user_ids)
    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="madp-verify-batches-") as folder:
        selection = _Buckets(_bucket_count(_input_files(data_path), buckets), folder, "selected")
        inputs = _read_inputs(output, data_path, selected, users_from, problems, selection)
        layout = inputs.layout
        if problems or layout is None:
            return {"ok": False, "violation_count": len(problems), "violations": problems}
        violations: list[str] = []
        batched = _read_batches(layout, inputs.report.get("sampler") == "users", violations)
        violations += _padding_problems(layout, batched)
        records = _read_records(
            data_path, id_column, users_from, _Buckets(selection.count, folder, "rows"), batched, violations
        )
        # The bound over the whole selection, whatever the batches sampled of it.
        joined = _join_selection(selection, records.rows, selected, data_path, [], batched.steps_of)
        placed = _place_rows(batched, records, joined.kept_copies, data_path, selected, violations)
        violations += _user_identity_problems(batched.user_values, records.users_of)
        violations += _in_order(joined.not_once)
        totals = _user_totals(joined.contributions, _user_bounds(capacities_path, max_contributions, violations))
        violations += _over_bound_problems(totals.over, joined.contributions, max_contributions)
    over = totals.over
    participations = _participations(placed.steps_of_user, min_sep, max_participations, violations)
    if max_batch_size is not None:
        violations += [
            f"step {step} has {rows} rows (> max batch size {max_batch_size})"
            for step, rows in sorted(batched.rows_per_step.items())
            if rows > max_batch_size
        ]
    closest, steps_of_user = participations.closest, placed.steps_of_user
    return {
        "ok": not violations,
        "files": len(inputs.files),
        "steps": len(batched.rows_per_step),
        "rows": batched.real_rows + batched.padding_rows,
        "real_rows": batched.real_rows,
        "padding_rows": batched.padding_rows,
        "users": len(steps_of_user),
        "max_participations": max((len(set(s)) for s in steps_of_user.values()), default=0),
        "min_gap": closest[0][0] if closest else None,
        "user_rows_sharing_a_step": participations.repeated_in_step,
        "unknown_ids": placed.unknown,
        "unselected_rows": placed.unselected,
        "content_features": list(batched.content_names),
        "rows_with_other_content": sum(rows for _, rows in records.other_content),
        "contribution_bound": max_contributions,
        "max_user_contribution": totals.most,
        "users_over_bound": len(over),
        "violation_count": len(violations),
        "violations": violations[:_SHOWN],
    }


def _read_inputs(
    output: str, data_path: str, selected: str, users_from: _UsersFrom, problems: list[str], selection: _Buckets
) -> _Inputs:
    """The batch files OUTPUT/report.json lists (checked against their sizes and digests) and their layout,
    and the selection of the bound output `selected`, put in `selection`'s buckets by id; what leaves them
    unread or unknown is a problem (an id selected twice found a bucket at a time), as are missing records
    and users columns other than the bound's."""
    files, listing_problems = _listed_files(
        output, "files", "", lambda name: os.path.basename(name).startswith("batches-") and name.endswith(".tfrecord")
    )
    problems += listing_problems
    report, _ = _report(output)
    layout, layout_problems = _batch_layout(files, report, output) if not problems else (None, [])
    problems += layout_problems
    problems += [f"no records at {data_path}"] if not os.path.exists(data_path) else []
    shards, selection_problems = _listed_files(selected, "selection_files", "selected", lambda name: True)
    problems += selection_problems
    entries: list[tuple[int, int, str]] = []
    for entry in _selection_entries(selected, shards, entries):
        selection.put(entry[1], entry)
    for bucket in range(selection.count):
        _copies_of(selection.items(bucket), selected, entries)
    problems += _in_order(entries)
    problems += _other_users_columns(selected, users_from, "verify-batches") if not selection_problems else []
    return _Inputs(files, report, layout, selection)


def _padding_problems(layout: _Layout, batched: _Batched) -> list[str]:
    """Padded batches (the report's B_max, or any padding row) hold the same rows in every step: a step with
    other than that many lost rows (a batch file cut short?) or gained some."""
    padded_to = layout.padded_to or (max(batched.rows_per_step.values()) if batched.padding_rows else None)
    if padded_to is None:
        return []
    return [
        f"step {step} holds {batched.rows_per_step[step]} rows, not the {padded_to} every step of padded "
        f"batches holds: rows are missing (a batch file cut short?) or added"
        for step in range(layout.steps)
        if batched.rows_per_step[step] != padded_to
    ]


def _read_records(
    data_path: str, id_column: str, users_from: _UsersFrom, rows: _Buckets, batched: _Batched, violations: list[str]
) -> _Records:
    """DATA, streamed: every record's (id, users) put in `rows`' buckets, the users of the batched records, and
    the content of the batched checked against their rows'; an unreadable file, a string user id showing a sign
    (without --user-ids) and each other content are violations."""
    users_of: dict = {}
    occurrences: Counter = Counter()
    other_content = []
    suspects = _Suspects()
    for path in _input_files(data_path):
        for record_id, users, values in _readable_rows(
            path, id_column, users_from, violations, suspects, batched.content_names
        ):
            rows.put(record_id, (record_id, users))
            if record_id in batched.steps_of:
                occurrences[record_id] += 1
                users_of[record_id] = set(users)
                if occurrences[record_id] == 1 and record_id in batched.content:
                    other_content += _other_content(record_id, values, batched, data_path)
    violations += suspects.violations()
    violations += [violation for violation, _ in other_content]
    return _Records(users_of, occurrences, other_content, rows)


def _place_rows(
    batched: _Batched, records: _Records, copies_of: dict, data_path: str, selected: str, violations: list[str]
) -> _Placed:
    """Each batched record's rows given to its users' steps; a violation for an id DATA lacks or holds twice,
    one the selection lacks (`copies_of`: the batched ids it selects), and a record in more rows of a step
    than its copies."""
    users_of, occurrences = records.users_of, records.occurrences
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
    return _Placed(steps_of_user, unknown, unselected)


def _over_bound_problems(over: list[tuple], contributions: _Buckets, max_contributions: int) -> list[str]:
    """A violation for each user over its bound in the selection, naming its first selected records (of the
    (user, copies, id) in `contributions`' buckets)."""
    over_users = {user for user, _, _ in over}
    records_of_user: defaultdict = defaultdict(list)
    for bucket in range(contributions.count if over_users else 0):
        for user, _, record_id in contributions.items(bucket):
            if user in over_users:
                records_of_user[user].append(record_id)
    return [
        f"user {user!r} has {count} records (copies counted) in the selection, over "
        f"{f'the contribution bound {bound}' if bound == max_contributions else f'its capacity {bound}'}: "
        f"records {sorted(records_of_user[user], key=str)[:10]}"
        for user, count, bound in over
    ]


def _participations(
    steps_of_user: dict, min_sep: int, max_participations: int | None, violations: list[str]
) -> _Participations:
    """Each user's participations: a violation for two closer than `min_sep` steps, and for more steps than
    `max_participations`, the most first."""
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
    return _Participations(closest, repeated_in_step)
