"""The verifiers check an input in buckets on disk, one in memory at a time: many buckets give the verdict of
one, and a violation is caught in whichever bucket its user's rows fall."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
from conftest import write_records
from test_verify_and_cli import batch, bound, corrupt, run_cli, verify_batches

from madp.core.verify import buckets


@pytest.fixture(autouse=True)
def small_writes(monkeypatch):
    """Buckets written to disk a few items at a time, as a large input's are."""
    monkeypatch.setattr(buckets, "_HELD_ITEMS", 64)


def verify(capsys, input_path, output, *extra) -> tuple[int, dict]:
    code, verdict, _ = run_cli(capsys, "verify-bound", input_path, str(output), "-k", "2", *extra)
    return code, verdict


def tamper(rows: list[dict]) -> list[dict]:
    """Over the bound (one record's copies raised), an unknown id, an id twice, and invalid copies."""
    changed = [{**r, "copies": r["copies"] + 1} if i in (0, 5) else r for i, r in enumerate(rows)]
    changed[7] = {**changed[7], "copies": 0}
    return [*changed, {"id": 10**9, "copies": 1}, rows[3]]


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_many_buckets_give_the_verdict_of_one(tmp_path, capsys, monkeypatch, small_graph, suffix):
    input_path = write_records(str(tmp_path / f"in.{suffix}"), small_graph)
    bound(tmp_path, capsys, input_path)
    one = verify(capsys, input_path, tmp_path / "out", "--buckets", "1")
    assert one[0] == 0 and one[1]["ok"]
    assert verify(capsys, input_path, tmp_path / "out", "--buckets", "13") == one
    corrupt(tmp_path, tamper)
    code, verdict = verify(capsys, input_path, tmp_path / "out", "--buckets", "1")
    assert code == 1 and verdict["users_over_bound"] >= 1 and verdict["violation_count"] >= 5
    assert verify(capsys, input_path, tmp_path / "out", "--buckets", "13") == (code, verdict)
    monkeypatch.setattr(buckets, "_INPUT_BYTES_PER_BUCKET", 2048)  # the count the input's size gives
    assert buckets._bucket_count([input_path], None) > 5
    assert verify(capsys, input_path, tmp_path / "out") == (code, verdict)


def test_a_user_over_its_bound_is_caught_in_one_bucket_among_many(tmp_path, capsys, small_graph):
    input_path = write_records(str(tmp_path / "in.parquet"), small_graph)
    bound(tmp_path, capsys, input_path)
    user = small_graph[0]["users"][0]
    of_user = {row["id"] for row in small_graph if user in row["users"]}
    corrupt(tmp_path, lambda rows: [{**r, "copies": 3} if r["id"] in of_user else r for r in rows])
    code, verdict = verify(capsys, input_path, tmp_path / "out", "--buckets", "50")
    assert code == 1 and not verdict["ok"]
    assert any(v.startswith(f"user {user!r} contributes ") for v in verdict["violations"])
    assert verify(capsys, input_path, tmp_path / "out", "--buckets", "1") == (code, verdict)
    code, _, err = run_cli(capsys, "verify-bound", input_path, str(tmp_path / "out"), "-k", "2", "--buckets", "0")
    assert code == 2 and "--buckets must be at least 1" in err


def test_verify_batches_gives_the_verdict_of_one_bucket_and_catches_the_user_over(tmp_path, capsys):
    """User 0 holds 4 selected records under K = 3 (a faulty bound with a consistent report): caught in one
    bucket of many, with the same verdict as in one bucket; a sound selection passes in both."""
    rows = [
        {"id": i, "users": [0, 1000 + i] if i < 6 else [1000 + i, 2000 + i % 50], "x": float(i)} for i in range(600)
    ]
    data = write_records(str(tmp_path / "d.jsonl"), rows)
    code, _, _ = run_cli(capsys, "bound", data, str(tmp_path / "out"), "-k", "3", "--runner", "local")
    assert code == 0
    batch(capsys, tmp_path / "out", data, tmp_path / "sound", "--batch-size", "4", "--seed", "1")
    one = verify_batches(capsys, tmp_path / "sound", data, tmp_path / "out", "-k", "3", "--buckets", "1")
    assert one[0] == 0 and one[1]["ok"]
    assert verify_batches(capsys, tmp_path / "sound", data, tmp_path / "out", "-k", "3", "--buckets", "17") == one
    kept = {r["id"] for r in pq.read_table(tmp_path / "out" / "selected").to_pylist()}
    extra = min(set(range(6)) - kept)
    corrupt(tmp_path, lambda rows: [*rows, {"id": extra, "copies": 1}])
    batch(capsys, tmp_path / "out", data, tmp_path / "b", "--batch-size", "4", "--seed", "1")
    code, verdict = verify_batches(capsys, tmp_path / "b", data, tmp_path / "out", "-k", "3", "--buckets", "17")
    assert code == 1 and verdict["users_over_bound"] == 1 and verdict["max_user_contribution"] == 4
    assert any(v.startswith("user 0 has 4 records (copies counted) in the selection") for v in verdict["violations"])
    assert verify_batches(capsys, tmp_path / "b", data, tmp_path / "out", "-k", "3", "--buckets", "1") == (
        code,
        verdict,
    )
