"""verify-bound and verify-batches check outputs independently; the CLI runs the whole job and fails clearly."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import reseal_batches, reseal_selection, rewrite_batches, write_records

from madp.cli import main
from madp.core.verify.tfrecords import _example_class, read_tfrecord


def run_cli(capsys, *args) -> tuple[int, dict | None, str]:
    code = main(["-q", *args])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.strip() else None), err


def bound(tmp_path, capsys, input_path, *extra):
    code, report, _ = run_cli(
        capsys, "bound", input_path, str(tmp_path / "out"), "-k", "2", "--runner", "local", *extra
    )
    assert code == 0
    return report


def corrupt(tmp_path, mutate):
    shard = tmp_path / "out" / "selected" / "part-00000-of-00001.parquet"
    rows = pq.read_table(shard).to_pylist()
    pq.write_table(pa.Table.from_pylist(mutate(rows)), shard)
    reseal_selection(tmp_path / "out")


def test_generate_bound_verify_end_to_end(tmp_path, capsys):
    code, generated, _ = run_cli(capsys, "generate", str(tmp_path / "data"), "--records", "5000", "--seed", "3")
    assert code == 0 and generated["records"] == 5000 and len(os.listdir(tmp_path / "data")) == 4
    report = bound(tmp_path, capsys, str(tmp_path / "data"))
    assert report["converged"] and report["max_user_contribution"] <= 2
    code, verdict, _ = run_cli(capsys, "verify-bound", str(tmp_path / "data"), str(tmp_path / "out"), "-k", "2")
    assert code == 0 and verdict["ok"] and verdict["selected_records"] == report["selected_records"]
    assert verdict["max_user_contribution"] == report["max_user_contribution"]


def test_verify_fails_on_user_over_bound(tmp_path, capsys, small_graph):
    input_path = write_records(str(tmp_path / "in.jsonl"), small_graph)
    bound(tmp_path, capsys, input_path)
    corrupt(tmp_path, lambda rows: [{**r, "copies": r["copies"] + 1} if i == 0 else r for i, r in enumerate(rows)])
    code, verdict, _ = run_cli(capsys, "verify-bound", input_path, str(tmp_path / "out"), "-k", "2")
    assert code == 1 and not verdict["ok"] and verdict["users_over_bound"] >= 1
    assert "contributes 3 records, bound 2" in verdict["violations"][0]


def test_verify_fails_on_unknown_id_and_tighter_capacity(tmp_path, capsys, small_graph):
    input_path = write_records(str(tmp_path / "in.parquet"), small_graph)
    bound(tmp_path, capsys, input_path)
    code, verdict, _ = run_cli(capsys, "verify-bound", input_path, str(tmp_path / "out"), "-k", "1")
    assert code == 1 and verdict["users_over_bound"] > 0, "a smaller bound than the one used must fail"
    corrupt(tmp_path, lambda rows: rows + [{"id": 10**9, "copies": 1}])
    code, verdict, _ = run_cli(capsys, "verify-bound", input_path, str(tmp_path / "out"), "-k", "2")
    assert code == 1 and f"selected id {10**9} is not in the input" in verdict["violations"]


def test_verify_with_capacities_file(tmp_path, capsys, small_graph):
    input_path = write_records(str(tmp_path / "in.parquet"), small_graph)
    capacities = tmp_path / "caps.jsonl"
    capacities.write_text("".join(json.dumps({"user": u, "capacity": 0}) + "\n" for u in range(50)))
    bound(tmp_path, capsys, input_path, "--capacities", str(capacities))
    code, verdict, _ = run_cli(
        capsys, "verify-bound", input_path, str(tmp_path / "out"), "-k", "2", "--capacities", str(capacities)
    )
    assert code == 0 and verdict["ok"]
    code, verdict, _ = run_cli(capsys, "verify-bound", input_path, str(tmp_path / "out"), "-k", "2")
    assert code == 0, "capacities 0 only make the selection stricter"


def test_cli_errors_are_clear(tmp_path, capsys):
    code, _, err = run_cli(capsys, "bound", str(tmp_path / "missing"), str(tmp_path / "out"), "-k", "2")
    assert code == 2 and "madp bound: error:" in err and "no such file" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "users": []}\n')
    code, _, err = run_cli(capsys, "bound", str(bad), str(tmp_path / "out"), "-k", "2", "--runner", "local")
    assert code == 2 and "row 0: empty_users" in err
    code, _, err = run_cli(
        capsys, "bound", str(bad), str(tmp_path / "out"), "-k", "2", "--runner", "local", "--project", "x"
    )
    assert code == 2 and "takes no runner options" in err
    code, _, err = run_cli(
        capsys, "bound", str(bad), str(tmp_path / "out"), "-k", "2", "--runner", "local", "--partitions", "3"
    )
    assert code == 2 and "takes no runner options (got --partitions 3)" in err
    # madp's own runner options are checked by the driver before any pipeline runs
    code, _, err = run_cli(capsys, "bound", str(bad), str(tmp_path / "out"), "-k", "2", "--partitions", "0")
    assert code == 2 and "--partitions and --rounds-per-pipeline must be at least 1" in err
    code, _, err = run_cli(
        capsys,
        "batch",
        str(tmp_path / "bound"),
        str(bad),
        str(tmp_path / "b"),
        "--steps",
        "2",
        "--batch-size",
        "1",
        "--rounds-per-pipeline",
        "2",
    )
    assert code == 2 and "--rounds-per-pipeline is an option of madp bound, not of madp batch" in err


def test_generate_single_files_are_valid_input(tmp_path, capsys):
    for name in ("records.jsonl", "records.parquet"):
        code, generated, _ = run_cli(
            capsys, "generate", str(tmp_path / name), "--records", "300", "--graph", "regular", "--features", "3"
        )
        assert code == 0 and generated["records"] == 300
        code, report, _ = run_cli(
            capsys, "bound", str(tmp_path / name), str(tmp_path / f"out-{name}"), "-k", "1", "--runner", "local"
        )
        assert code == 0 and report["input_records"] == 300 and report["rejected_total"] == 0
    first = open(tmp_path / "records.jsonl").readline()
    assert set(json.loads(first)) == {"id", "users", "features", "label"} and len(json.loads(first)["features"]) == 3


def test_verify_applies_csv_capacities_to_string_user_ids(tmp_path, capsys):
    rows = [{"id": i, "users": ["123"]} for i in range(3)]
    input_path = write_records(str(tmp_path / "in.jsonl"), rows)
    capacities = tmp_path / "caps.csv"
    capacities.write_text("user,capacity\n123,1\n")
    report = bound(tmp_path, capsys, input_path, "--capacities", str(capacities))
    assert report["selected_records"] == 1, "the producer applies capacity 1 to user '123'"
    corrupt(tmp_path, lambda rows: [{**rows[0], "copies": 2}])
    code, verdict, _ = run_cli(
        capsys, "verify-bound", input_path, str(tmp_path / "out"), "-k", "2", "--capacities", str(capacities)
    )
    assert code == 1 and "user '123' contributes 2 records, bound 1" in verdict["violations"]


def test_verify_never_passes_on_missing_evidence(tmp_path, capsys, small_graph):
    input_path = write_records(str(tmp_path / "in.parquet"), small_graph)
    code, verdict, _ = run_cli(capsys, "verify-bound", input_path, str(tmp_path / "nowhere"), "-k", "2")
    assert code == 1 and verdict["violations"] == [
        f"no {tmp_path / 'nowhere' / 'report.json'}: the run did not finish, its output is incomplete"
    ]
    bound(tmp_path, capsys, input_path)
    code, verdict, _ = run_cli(capsys, "verify-bound", str(tmp_path / "gone.parquet"), str(tmp_path / "out"), "-k", "2")
    assert code == 1 and "no input at" in verdict["violations"][0]


# --- verify-batches re-derives what training relies on from the data ------------------------------


def batch(capsys, selected, data, output, *extra) -> None:
    code, _, err = run_cli(
        capsys, "batch", str(selected), str(data), str(output), "--steps", "6", "--runner", "local", *extra
    )
    assert code == 0, err


def verify_batches(capsys, output, data, selected, *extra) -> tuple[int, dict]:
    code, verdict, _ = run_cli(
        capsys, "verify-batches", str(output), str(data), "--min-sep", "1", "--selected", str(selected), *extra
    )
    return code, verdict


def examples(path) -> list:
    example_class = _example_class()
    return [example_class.FromString(payload) for payload in read_tfrecord(str(path))]


def test_verify_batches_checks_the_bound_over_the_whole_selection(tmp_path, capsys):
    """A selection where user 0 holds 4 records under K = 3 (a faulty bound with a consistent report):
    verify-bound catches it, and so must verify-batches, whichever records the batches happen to hold."""
    rows = [{"id": i, "users": [0, 1000 + i] if i < 6 else [1000 + i], "x": float(i)} for i in range(300)]
    data = write_records(str(tmp_path / "d.jsonl"), rows)
    code, _, _ = run_cli(capsys, "bound", data, str(tmp_path / "out"), "-k", "3", "--runner", "local")
    assert code == 0
    kept = {r["id"] for r in pq.read_table(tmp_path / "out" / "selected").to_pylist()}
    extra = min(set(range(6)) - kept)
    corrupt(tmp_path, lambda rows: rows + [{"id": extra, "copies": 1}])
    code, verdict, _ = run_cli(capsys, "verify-bound", data, str(tmp_path / "out"), "-k", "3")
    assert code == 1 and "user 0 contributes 4 records, bound 3" in verdict["violations"]
    for seed in range(6):
        batch(capsys, tmp_path / "out", data, tmp_path / f"b{seed}", "--batch-size", "2", "--seed", str(seed))
        code, verdict = verify_batches(capsys, tmp_path / f"b{seed}", data, tmp_path / "out", "-k", "3")
        assert code == 1 and verdict["users_over_bound"] == 1 and verdict["max_user_contribution"] == 4
        assert any(
            v.startswith("user 0 has 4 records (copies counted) in the selection, over the contribution bound 3")
            for v in verdict["violations"]
        ), verdict
    assert verify_batches(capsys, tmp_path / "b0", data, tmp_path / "out", "-k", "4")[0] == 0


def test_verify_batches_holds_listed_users_to_their_capacities(tmp_path, capsys):
    rows = [{"id": i, "users": [0, 1000 + i] if i < 6 else [1000 + i], "x": float(i)} for i in range(100)]
    data = write_records(str(tmp_path / "d.jsonl"), rows)
    capacities = tmp_path / "caps.csv"
    capacities.write_text("user,capacity\n0,2\n")
    bound(tmp_path, capsys, data, "--capacities", str(capacities))  # K = 2, user 0 at most 2 records
    kept = {r["id"] for r in pq.read_table(tmp_path / "out" / "selected").to_pylist()}
    corrupt(tmp_path, lambda rows: rows + [{"id": min(set(range(6)) - kept), "copies": 1}])
    batch(capsys, tmp_path / "out", data, tmp_path / "b", "--batch-size", "2", "--seed", "1")
    assert verify_batches(capsys, tmp_path / "b", data, tmp_path / "out", "-k", "3")[0] == 0, "3 is within K = 3"
    code, verdict = verify_batches(
        capsys, tmp_path / "b", data, tmp_path / "out", "-k", "3", "--capacities", str(capacities)
    )
    assert code == 1 and any(
        v.startswith("user 0 has 3 records (copies counted) in the selection, over its capacity 2")
        for v in verdict["violations"]
    ), verdict


@pytest.mark.parametrize("name", ["d.jsonl", "d.parquet"])
def test_verify_batches_re_derives_each_rows_content_from_the_records(tmp_path, capsys, name):
    """Rows that keep a selected id but carry another record's features and label are not DATA's."""
    rows = [
        {"id": i, "users": [i % 40], "x": [i / 3, 1.0], "label": i % 3, "text": f"record {i}", "flag": i % 2 == 0}
        for i in range(120)
    ]
    data = write_records(str(tmp_path / name), rows)
    bound(tmp_path, capsys, data)
    batch(capsys, tmp_path / "out", data, tmp_path / "b", "--batch-size", "10", "--seed", "2")
    code, clean = verify_batches(capsys, tmp_path / "b", data, tmp_path / "out", "-k", "2")
    assert code == 0, clean
    real = [(n, e) for n, e in enumerate(examples(tmp_path / "b" / "batches-00000-of-00001.tfrecord"))]
    real = [(n, e) for n, e in real if e.features.feature["weight"].float_list.value[0] == 1.0]

    def id_of(row) -> int:
        return row[1].features.feature["id"].int64_list.value[0]

    # Two records that differ in every feature: another flag (parity) and another label (mod 3).
    (first, mine), (_, other) = next((a, b) for a in real for b in real if (id_of(a) - id_of(b)) % 6 in (1, 5))
    record = id_of((first, mine))

    def carry_the_others(number, example):
        if number == first:
            for feature in ("x", "label", "text", "flag"):
                example.features.feature[feature].ParseFromString(other.features.feature[feature].SerializeToString())

    rewrite_batches(tmp_path / "b", carry_the_others)
    code, verdict = verify_batches(capsys, tmp_path / "b", data, tmp_path / "out", "-k", "2")
    assert code == 1 and verdict["rows_with_other_content"] == 1, verdict
    assert verdict["violations"] == [
        f"batches-00000-of-00001.tfrecord record {first}: step {mine.features.feature['step'].int64_list.value[0]}: "
        f"id {record}: ['flag', 'label', 'text', 'x'] differ from its record in {data}"
    ]
    # A float rounded otherwise than float32 is another value too.
    rewrite_batches(tmp_path / "b", lambda n, e: n == first and e.ParseFromString(mine.SerializeToString()))
    assert verify_batches(capsys, tmp_path / "b", data, tmp_path / "out", "-k", "2")[0] == 0
    x = rows[record]["x"][0]
    nudged = np.nextafter(np.float32(x), np.float32(np.inf))
    rewrite_batches(
        tmp_path / "b", lambda n, e: n == first and e.features.feature["x"].float_list.value.__setitem__(0, nudged)
    )
    code, verdict = verify_batches(capsys, tmp_path / "b", data, tmp_path / "out", "-k", "2")
    assert code == 1 and verdict["violations"][0].endswith(f"id {record}: ['x'] differ from its record in {data}")
    assert clean["content_features"] == ["flag", "label", "text", "x"] and clean["rows_with_other_content"] == 0


def test_verify_batches_checks_user_level_rows_carry_their_users_identity(tmp_path, capsys):
    rows = [{"id": i, "users": [f"user-{i % 25}"], "x": float(i)} for i in range(100)]
    data = write_records(str(tmp_path / "d.jsonl"), rows)
    bound(tmp_path, capsys, data, "-k", "4")
    batch(capsys, tmp_path / "out", data, tmp_path / "b", "--sampler", "users", "--batch-size", "5", "--seed", "3")
    assert verify_batches(capsys, tmp_path / "b", data, tmp_path / "out", "-k", "4")[0] == 0
    real = [(n, e) for n, e in enumerate(examples(tmp_path / "b" / "batches-00000-of-00001.tfrecord"))]
    users = {e.features.feature["user"].int64_list.value[0]: n for n, e in real}
    (first, _), (_, other) = list(users.items())[:2]
    # Another user's identity on a row: per-user clipping would clip the two users' rows together.
    rewrite_batches(
        tmp_path / "b", lambda n, e: n == other and e.features.feature["user"].int64_list.value.__setitem__(0, first)
    )
    code, verdict = verify_batches(capsys, tmp_path / "b", data, tmp_path / "out", "-k", "4")
    assert code == 1 and any("per-user clipping would merge them" in v for v in verdict["violations"]), verdict


def test_verify_batches_finds_a_batch_file_cut_short_from_the_data(tmp_path, capsys):
    """Padded batches hold B_max rows in every step: a file cut at a record boundary, or left out, with
    the listing rewritten to match, is caught from the rows; one cut inside a record is named."""
    data = write_records(str(tmp_path / "d.jsonl"), [{"id": i, "users": [i % 50], "x": float(i)} for i in range(200)])
    bound(tmp_path, capsys, data)
    shards = ["--batch-size", "4", "--max-batch-size", "8", "--output-shards", "2", "--seed", "4"]
    batch(capsys, tmp_path / "out", data, tmp_path / "b", *shards)
    code, verdict = verify_batches(capsys, tmp_path / "b", data, tmp_path / "out", "-k", "2")
    assert code == 0 and verdict["rows"] == 6 * 8, verdict
    path = tmp_path / "b" / "batches-00000-of-00002.tfrecord"
    whole = path.read_bytes()
    last = len(list(read_tfrecord(str(path)))[-1]) + 16
    path.write_bytes(whole[:-last])  # the last record of step 2 gone, at a record boundary
    reseal_batches(tmp_path / "b")
    code, verdict = verify_batches(capsys, tmp_path / "b", data, tmp_path / "out", "-k", "2")
    assert code == 1 and verdict["violations"] == [
        "step 2 holds 7 rows, not the 8 every step of padded batches holds: rows are missing (a batch file cut "
        "short?) or added"
    ], verdict
    # Cut inside the last record's checksum: named, no traceback.
    path.write_bytes(whole[:-2])
    reseal_batches(tmp_path / "b")
    code, verdict = verify_batches(capsys, tmp_path / "b", data, tmp_path / "out", "-k", "2")
    assert code == 1 and any(
        v.startswith("batches-00000-of-00002.tfrecord: unreadable after record 22:") and "cut short" in v
        for v in verdict["violations"]
    ), verdict
    # A whole file left out of the listing.
    path.write_bytes(whole)
    os.remove(tmp_path / "b" / "batches-00001-of-00002.tfrecord")
    reseal_batches(tmp_path / "b")
    code, verdict = verify_batches(capsys, tmp_path / "b", data, tmp_path / "out", "-k", "2")
    assert code == 1 and "the batch files are numbers [0] of 2" in verdict["violations"][0], verdict
