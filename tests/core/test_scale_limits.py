"""Sizes past one machine's memory: `madp generate` draws them part by part in bounded memory, and the local
engine refuses them before it reads (`madp bound --runner local` and `madp batch --runner local` estimate the
input's rows from Parquet metadata and JSON Lines file sizes, and name the engines that can), writing nothing."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from madp.cli import main
from madp.core import errors
from madp.engines import local_engine
from madp.tools.data import synthetic, synthetic_text
from madp.tools.data.synthetic import generate, to_table

GIB = 1 << 30


def cli(capsys, *args) -> tuple[int, str]:
    code = main(["-q", *map(str, args)])
    return code, capsys.readouterr().err


def small_machine(monkeypatch, size: int) -> None:
    monkeypatch.setattr(errors, "memory_limit", lambda: errors.MemoryLimit(size, None))


@pytest.fixture
def records(tmp_path, capsys) -> str:
    path = tmp_path / "records.parquet"
    assert cli(capsys, "generate", path, "--records", "3000", "--seed", "1")[0] == 0
    return str(path)


def written(directory) -> list[str]:
    return sorted(os.listdir(directory)) if os.path.exists(directory) else []


def test_a_bound_past_memory_is_refused_by_its_parquet_row_count(tmp_path, capsys, monkeypatch, records):
    small_machine(monkeypatch, 2 * 3000 * local_engine.BYTES_PER_RECORD - 1)
    code, err = cli(capsys, "bound", records, tmp_path / "out", "-k", "3", "--runner", "local")
    assert code == 2 and "Traceback" not in err
    assert f"madp bound --runner local on about 3,000 records ({records}) holds about 1 MiB in memory" in err
    assert "more than half of this machine's 2 MiB: run it with --runner pyspark" in err
    assert not os.path.exists(tmp_path / "out")  # the folder the refused run's lock made is gone with it
    small_machine(monkeypatch, 2 * 3000 * local_engine.BYTES_PER_RECORD)
    assert cli(capsys, "bound", records, tmp_path / "out", "-k", "3", "--runner", "local")[0] == 0


def test_a_json_lines_input_is_estimated_from_its_size(tmp_path, capsys, monkeypatch):
    rows = [{"id": i, "users": [i % 50, 100 + i % 7], "label": i % 2} for i in range(20000)]
    plain = tmp_path / "records.jsonl"
    plain.write_text("".join(json.dumps(row) + "\n" for row in rows))
    estimate = local_engine.estimated_rows(str(plain))
    assert 19000 < estimate < 21000
    small_machine(monkeypatch, GIB // 1024)
    code, err = cli(capsys, "bound", plain, tmp_path / "out", "-k", "3", "--runner", "local")
    assert code == 2 and f"on about {estimate:,} records ({plain}) holds" in err
    assert written(tmp_path / "out") == []


def test_a_batch_past_memory_is_refused_before_it_reads(tmp_path, capsys, monkeypatch, records):
    assert cli(capsys, "bound", records, tmp_path / "bounded", "-k", "3", "--runner", "local")[0] == 0
    batch = ["batch", tmp_path / "bounded", records, tmp_path / "batches", "--steps", "4", "--batch-size", "8"]
    small_machine(monkeypatch, 2 * 3000 * local_engine.BYTES_PER_RECORD - 1)
    code, err = cli(capsys, *batch, "--min-sep", "1", "--seed", "0", "--runner", "local")
    assert code == 2 and "madp batch --runner local on about 3,000 records" in err and "--runner pyspark" in err
    assert written(tmp_path / "batches") == []


# --- madp generate past what a draw made whole holds ------------------------------------------------------


def degree_figures(users: list[list[int]]) -> tuple[float, float, float]:
    """(fraction of users in one record, median and 90th percentile of records per user)."""
    degree = np.bincount([user for record in users for user in record])
    degree = degree[degree > 0]
    return float((degree == 1).mean()), float(np.median(degree)), float(np.percentile(degree, 90))


@pytest.mark.parametrize("graph", ["skewed", "regular"])
def test_a_draw_past_the_whole_size_is_made_part_by_part_with_the_same_graph(tmp_path, capsys, monkeypatch, graph):
    """Each part is a whole draw of its size among users of its own: ids 0..N-1 once each (held out or not),
    no user in two parts, the users per record and the shape of the degree distribution of a whole draw of
    a part's size."""
    part = 2000
    monkeypatch.setattr(synthetic, "WHOLE_DRAW_BYTES", 0)
    monkeypatch.setattr(synthetic, "PART_BYTES", part * synthetic.GraphSpec(records=1).bytes_per_record)
    out, held = tmp_path / "records", tmp_path / "held.parquet"
    flags = ["--records", "10000", "--graph", graph, "--seed", "4"]
    assert cli(capsys, "generate", out, *flags, "--shards", "3", "--holdout", held)[0] == 0
    table = pa.concat_tables([pq.read_table(out), pq.read_table(held)]).sort_by("id")
    assert table.column("id").to_pylist() == list(range(10000))
    assert len(os.listdir(out)) == 3 and 0 < pq.read_metadata(held).num_rows < 1500
    users = table.column("users").to_pylist()
    parts_of_user: dict = {}
    for record_id, record_users in enumerate(users):
        assert len(set(record_users)) == len(record_users) >= 1
        for user in record_users:
            parts_of_user.setdefault(user, set()).add(record_id // part)
    assert all(len(parts) == 1 for parts in parts_of_user.values())
    whole = to_table(generate(synthetic.GraphSpec(records=part, graph=graph, seed=4))).column("users").to_pylist()
    arity = np.mean([len(u) for u in users])
    assert abs(arity - np.mean([len(u) for u in whole])) < 0.1 and abs(arity - 2.0) < 0.05
    ones, median, high = degree_figures(users)
    whole_ones, whole_median, whole_high = degree_figures(whole)
    assert abs(ones - whole_ones) < 0.03 and median == whole_median and abs(high - whole_high) <= 1
    # The bound reads it as any dataset.
    assert cli(capsys, "bound", out, tmp_path / "bounded", "-k", "2", "--runner", "local")[0] == 0


def test_a_text_draw_in_parts_gives_each_part_its_own_texts(tmp_path, monkeypatch):
    monkeypatch.setattr(synthetic, "WHOLE_DRAW_BYTES", 0)
    monkeypatch.setattr(synthetic, "PART_BYTES", 500 * synthetic.GraphSpec(records=1, task="text").bytes_per_record)
    spec = synthetic.GraphSpec(records=1500, task="text", seed=2)
    summary = synthetic.write_generated(spec, str(tmp_path / "t.jsonl"), 1, users_as="both")
    rows = [json.loads(line) for line in open(tmp_path / "t.jsonl")]
    assert [row["id"] for row in rows] == list(range(1500)) and summary["records"] == 1500
    assert rows[0]["text"] != rows[500]["text"] and rows[0]["label"] in synthetic_text.TOPICS
    assert sum(summary["labels"].values()) == 1500
    assert all(row["from"] == row["users"][0] for row in rows)
    assert [row["id"] for row in rows if row["cc"] and row["cc"][-1] == row["from"]][:2] == [3, 11]


def test_a_draw_within_the_whole_size_is_the_one_a_seed_has_always_given(tmp_path):
    spec = synthetic.GraphSpec(records=3000, seed=9)
    assert spec.drawn_whole
    one, other = str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")
    assert synthetic.write_generated(spec, one, 1) == {
        **synthetic.write_dataset(generate(spec), spec, other, 1),
        "output": one,
    }
    assert open(one, "rb").read() == open(other, "rb").read()
