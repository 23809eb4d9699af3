"""A madp output as the verifiers read it: its report.json, the files it lists (each checked for its size
and SHA-256, no file outside its folder read), the selection's ids and copies, and the users columns and
--user-ids the bound recorded."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator

import pyarrow.parquet as pq

from madp.core.verify.records import _column_values, _scalar, _UsersFrom


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


def _selection_entries(selected: str, shards: list[str], problems: list[tuple[int, int, str]]) -> Iterator[tuple]:
    """(position, id, copies) of each entry of a bound output's selection `shards` (those its report lists:
    `_listed_files`), in order. An unreadable shard, an id that is no string or 64-bit integer (left out), or
    copies that are not a positive integer (then 0) is a problem (position, 1, violation); an id selected
    twice is found by `_copies_of`, at (position, 0)."""
    position = 0
    for shard in shards:
        position += 1
        try:
            table = pq.read_table(shard, columns=["id", "copies"], page_checksum_verification=True)
            ids, all_copies = _column_values(table.column("id")), table.column("copies").to_pylist()
        except (OSError, ValueError, KeyError) as error:
            problems.append((position, 1, f"{shard}: not a readable selection ({error})"))
            continue
        for record_id, copies in zip(ids, all_copies):
            position += 1
            if not _scalar(record_id):  # a list, a null, or text that is not UTF-8
                problems.append((position, 1, f"selected id {record_id!r} is not a string or a 64-bit integer"))
                continue
            if not isinstance(copies, int) or isinstance(copies, bool) or copies < 1:
                problems.append((position, 1, f"id {record_id!r} has invalid copies {copies!r} in {selected}/selected"))
                copies = 0
            yield position, record_id, copies


def _copies_of(entries: Iterable[tuple], selected: str, problems: list[tuple[int, int, str]]) -> tuple[dict, dict]:
    """({id: copies}, {id: position of its first entry}) of selection entries (`_selection_entries`), an id
    selected twice a problem at the position of its second entry (its copies the last entry's)."""
    copies_of: dict = {}
    first: dict = {}
    for position, record_id, copies in entries:
        if record_id in copies_of:
            problems.append((position, 0, f"id {record_id!r} is selected twice in {selected}/selected"))
        else:
            first[record_id] = position
        copies_of[record_id] = copies
    return copies_of, first


def _in_order(problems: list[tuple]) -> list[str]:
    """The violations of (position, ..., violation) problems, by position."""
    return [problem[-1] for problem in sorted(problems)]


def _selection(selected: str, shards: list[str], violations: list[str]) -> dict:
    """{id: copies} of a bound output's selection `shards`, its problems (`_selection_entries`) violations."""
    problems: list[tuple[int, int, str]] = []
    copies_of, _ = _copies_of(_selection_entries(selected, shards, problems), selected, problems)
    violations += _in_order(problems)
    return copies_of
