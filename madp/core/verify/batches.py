"""`madp verify-batches`: the batches re-read with the records and the selection they were made from."""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from collections.abc import Iterable

from madp.core.verify.batch_rows import (
    _batch_layout,
    _other_content,
    _read_batches,
    _user_identity_problems,
)
from madp.core.verify.bound import _SHOWN, _contributions, _over_bound, _selected_not_once, _user_bounds
from madp.core.verify.outputs import _listed_files, _other_users_columns, _report, _selection
from madp.core.verify.records import _input_files, _readable_rows, _UsersFrom
from madp.core.verify.user_ids import _Suspects


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
