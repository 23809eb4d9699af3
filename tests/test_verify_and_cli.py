"""verify-bound checks outputs independently; the CLI runs the whole job and fails clearly."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
from conftest import reseal_selection, write_records

from madp.cli import main


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
    assert code == 2 and "takes no Beam options" in err
    code, _, err = run_cli(
        capsys, "bound", str(bad), str(tmp_path / "out"), "-k", "2", "--runner", "local", "--partitions", "3"
    )
    assert code == 2 and "takes no Beam options (got --partitions 3)" in err
    # madp's own Beam options are checked by the driver before any pipeline runs
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
