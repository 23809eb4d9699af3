"""The graph trained on is the graph that was bounded: `madp bound` records a digest of the graph it
bounded, `madp batch` refuses records whose graph differs, and `madp verify-batches` re-derives the
bound from the records, the selection and the batches alone (never from the batch report), on the
local engine and on Beam, through the command line."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from conftest import reseal_selection, rewrite_batches, write_records

from madp.cli import main
from madp.core.errors import InputError
from madp.core.verify.tfrecords import _example_class, read_tfrecord

ENGINES = {
    "local": ["--runner", "local"],
    "beam": ["--runner", "DirectRunner", "--direct_running_mode", "in_memory", "--partitions", "3"],
}
ENGINE_CASES = ["local", pytest.param("beam", marks=pytest.mark.beam)]
BATCH = ["--steps", "30", "--batch-size", "20", "--seed", "5"]
HEAVY = 999  # the user DATA' gives 11 records


def cli(capsys, *args) -> tuple[int, dict | None, str]:
    code = main(["-q", *map(str, args)])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.strip().startswith("{") else None), err


def rows(count: int = 60, heavy: int = 0) -> list[dict]:
    """Every user in at most 2 records (K = 2 keeps them all); with `heavy`, records 0..heavy-1 are
    given user HEAVY instead of their first user: the same ids, another graph."""
    return [
        {"id": i, "users": [HEAVY if i < heavy else i, 500 + i % 30], "x": [float(i), 1.0], "label": i % 2}
        for i in range(count)
    ]


def data_pair(tmp_path) -> tuple[str, str]:
    """DATA and DATA': the same ids and content; in DATA' one user has 11 records."""
    return (
        write_records(str(tmp_path / "data.jsonl"), rows()),
        write_records(str(tmp_path / "other.jsonl"), rows(heavy=11)),
    )


def real_rows(output) -> list[tuple[int, int, int]]:
    """(record number, step, id) of each real row of the (single) batch file."""
    example_class = _example_class()
    found = []
    for number, payload in enumerate(read_tfrecord(os.path.join(output, "batches-00000-of-00001.tfrecord"))):
        feature = example_class.FromString(payload).features.feature
        if feature["weight"].float_list.value[0] == 1.0:
            found.append((number, feature["step"].int64_list.value[0], feature["id"].int64_list.value[0]))
    return found


def set_id(example, record_id: int) -> None:
    example.features.feature["id"].int64_list.value[0] = record_id


# --- the digest ---------------------------------------------------------------------------------


def test_graph_digest_depends_on_the_graph_only():
    from madp.core.graph_digest import GraphDigest, graph_digest

    rng = np.random.default_rng(4)
    arity = rng.integers(1, 4, 200)
    offsets = np.concatenate([[0], np.cumsum(arity)])
    users = rng.permutation(10_000)[: offsets[-1]]
    ids = pa.array(rng.permutation(1000)[:200])
    whole = graph_digest(ids, offsets, pa.array(users))
    assert (whole.records, whole.incidences) == (200, int(offsets[-1]))
    # Records in another order, users within each record in another order, and parts added up.
    order = rng.permutation(200)
    shuffled_users = np.concatenate([rng.permutation(users[offsets[r] : offsets[r + 1]]) for r in order])
    shuffled_offsets = np.concatenate([[0], np.cumsum(arity[order])])
    parts = [(0, 70), (70, 71), (71, 200)]
    total = GraphDigest((0, 0), 0, 0)
    for start, end in parts:
        part_users = shuffled_users[shuffled_offsets[start] : shuffled_offsets[end]]
        total = total + graph_digest(
            ids.take(pa.array(order[start:end])),
            shuffled_offsets[start : end + 1] - shuffled_offsets[start],
            pa.array(part_users),
        )
    assert total == whole
    assert GraphDigest.from_json(whole.to_report()) == whole
    assert GraphDigest.from_counts(whole.to_counts()) == whole and max(whole.to_counts().values()) < 2**32
    # One user moved to another record, two records' user sets swapped, a string id for an integer one.
    moved = users.copy()
    moved[[0, offsets[1]]] = moved[[offsets[1], 0]]
    assert graph_digest(ids, offsets, pa.array(moved)) != whole
    swapped = ids.take(pa.array([1, 0, *range(2, 200)]))
    assert graph_digest(swapped, offsets, pa.array(users)).hex != whole.hex
    assert graph_digest(pa.array(["7"]), np.array([0, 1]), pa.array([1])) != graph_digest(
        pa.array([7]), np.array([0, 1]), pa.array([1])
    )


def test_graph_digest_is_the_schemes_value_whatever_its_blocks(monkeypatch):
    """The definition is pinned (an earlier bound's digest must still compare), and digesting a
    partition block by block gives its one digest."""
    from madp.core import graph_digest as digest

    integer = (pa.array([3, -1, 2**40]), np.array([0, 2, 2, 5]), pa.array([5, 9, 1, 2, 3]))
    string = (pa.array(["a", "é"]), np.array([0, 1, 3]), pa.array(["x", "y", "z"]))
    assert digest.graph_digest(*integer).hex == "2b9861e3dfe3e26818257701c1dc15e8"
    assert digest.graph_digest(*string).hex == "c7638b0575ee5b90cab3a174737592ce"
    rng = np.random.default_rng(5)
    offsets = np.concatenate([[0], np.cumsum(rng.integers(0, 4, 300))])
    graph = (pa.array(rng.permutation(10**6)[:300]), offsets, pa.array(rng.integers(0, 50, offsets[-1])))
    whole = digest.graph_digest(*graph)
    monkeypatch.setattr(digest, "_BLOCK_RECORDS", 7)
    assert digest.graph_digest(*graph) == whole and digest.graph_digest(*integer).hex.startswith("2b9861e3")


@pytest.mark.beam
def test_both_engines_record_the_same_digest_whatever_the_sharding(tmp_path, capsys):
    data, _ = data_pair(tmp_path)
    os.makedirs(tmp_path / "split")
    write_records(str(tmp_path / "split" / "a.jsonl"), rows()[:25])
    write_records(str(tmp_path / "split" / "b.parquet"), rows()[25:])
    digests = []
    for name, source, engine in (
        ("local", data, ENGINES["local"]),
        ("beam", data, ENGINES["beam"]),
        ("sharded", tmp_path / "split", [*ENGINES["beam"][:-1], "5"]),
    ):
        code, report, err = cli(capsys, "bound", source, tmp_path / name, "-k", "2", *engine)
        assert code == 0, err
        digests.append(report["graph_digest"])
    assert digests[0] == digests[1] == digests[2]
    assert digests[0]["records"] == 60 and digests[0]["incidences"] == 120


# --- batch refuses another graph ----------------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINE_CASES)
def test_batch_refuses_records_that_are_not_the_graph_bounded(tmp_path, capsys, engine):
    """Same ids, one user given 11 records: batching them would train with K = 2 accounted and 11 held."""
    data, other = data_pair(tmp_path)
    code, bound, _ = cli(capsys, "bound", data, tmp_path / "b", "-k", "2", *ENGINES[engine])
    assert code == 0 and bound["distinct_selected"] == 60
    code, _, err = cli(capsys, "batch", tmp_path / "b", other, tmp_path / "out", *BATCH, *ENGINES[engine])
    assert code == 2 and "is not the graph SELECTED" in err and "--users-column users" in err
    assert not (tmp_path / "out").exists()  # no batch file: the refused run left no folder either
    # The records bounded are accepted, and the batch report records the bound's digest.
    code, report, _ = cli(capsys, "batch", tmp_path / "b", data, tmp_path / "out", *BATCH, *ENGINES[engine])
    assert code == 0 and report["bound"]["graph_digest"] == bound["graph_digest"]


def test_batch_refuses_other_users_columns_and_an_older_bound(tmp_path, capsys):
    records = [dict(r, people=r["users"], users=[1000 + r["id"]]) for r in rows()]
    data = write_records(str(tmp_path / "d.jsonl"), records)
    assert (
        cli(capsys, "bound", data, tmp_path / "b", "-k", "2", "--users-column", "people", "--runner", "local")[0] == 0
    )
    code, _, err = cli(capsys, "batch", tmp_path / "b", data, tmp_path / "out", *BATCH, "--runner", "local")
    assert code == 2 and "is not the graph SELECTED" in err and "--users-column people" in err
    args = ("batch", tmp_path / "b", data, tmp_path / "out", *BATCH, "--users-column", "people", "--runner", "local")
    assert cli(capsys, *args)[0] == 0
    report_path = tmp_path / "b" / "report.json"
    report = json.loads(report_path.read_text())
    del report["graph_digest"]
    report_path.write_text(json.dumps(report))
    code, _, err = cli(capsys, *args)
    assert code == 2 and "no graph_digest" in err and "re-run madp bound" in err


# --- verify-batches re-derives the bound --------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINE_CASES)
def test_verify_batches_finds_batches_made_from_another_graph(tmp_path, capsys, engine):
    """Batches of DATA' made with the selection of DATA (an old madp, or a swapped selection): the
    verifier re-derives from DATA', the selection and the batches that user 999 is over K, whatever
    the batch report says."""
    data, other = data_pair(tmp_path)
    assert cli(capsys, "bound", data, tmp_path / "b", "-k", "2", "--runner", "local")[0] == 0
    assert cli(capsys, "bound", other, tmp_path / "swapped", "-k", "2", "--runner", "local")[0] == 0
    for name in os.listdir(tmp_path / "swapped" / "selected"):
        os.remove(tmp_path / "swapped" / "selected" / name)
    for name in os.listdir(tmp_path / "b" / "selected"):
        shutil.copy(tmp_path / "b" / "selected" / name, tmp_path / "swapped" / "selected" / name)
    reseal_selection(tmp_path / "swapped")
    out = tmp_path / "out"
    assert cli(capsys, "batch", tmp_path / "swapped", other, out, *BATCH, *ENGINES[engine])[0] == 0
    check = ("verify-batches", out, other, "--min-sep", "1", "--max-contributions", "2")
    code, verdict, _ = cli(capsys, *check, "--selected", tmp_path / "swapped")
    assert code == 1 and verdict["users_over_bound"] == 1
    assert any(
        v.startswith(f"user {HEAVY} has ") and "over the contribution bound 2" in v for v in verdict["violations"]
    )
    # No help from the batch report: its bound record says anything, the verdict stays.
    report = json.loads((out / "report.json").read_text())
    report["bound"].update(contribution_bound=100, max_user_contribution=1, graph_digest=None, input_users=1)
    (out / "report.json").write_text(json.dumps(report))
    assert cli(capsys, *check, "--selected", tmp_path / "swapped")[1] == verdict
    assert cli(capsys, *check, "--selected", tmp_path / "b")[1] == verdict
    # The records the batches were made from, bounded honestly, pass.
    assert cli(capsys, "batch", tmp_path / "b", data, tmp_path / "good", *BATCH, *ENGINES[engine])[0] == 0
    code, verdict, _ = cli(
        capsys, "verify-batches", tmp_path / "good", data, "--min-sep", "1", "-k", "2", "--selected", tmp_path / "b"
    )
    assert code == 0 and verdict["ok"] and verdict["max_user_contribution"] == 2


def test_verify_batches_finds_an_unselected_record_and_too_many_rows(tmp_path, capsys):
    data = write_records(str(tmp_path / "d.jsonl"), [{"id": i, "users": [i % 20], "x": float(i)} for i in range(60)])
    code, bound, _ = cli(capsys, "bound", data, tmp_path / "b", "-k", "2", "--runner", "local")
    assert code == 0 and bound["distinct_selected"] == 40
    selected = set(pq.read_table(tmp_path / "b" / "selected").column("id").to_pylist())
    unselected = min(set(range(60)) - selected)
    for name in ("unselected", "twice"):
        assert cli(capsys, "batch", tmp_path / "b", data, tmp_path / name, *BATCH, "--runner", "local")[0] == 0

    def check(output):
        return cli(capsys, "verify-batches", output, data, "--min-sep", "1", "-k", "2", "--selected", tmp_path / "b")

    assert check(tmp_path / "unselected")[0] == 0
    number, _, _ = real_rows(tmp_path / "unselected")[0]
    rewrite_batches(tmp_path / "unselected", lambda n, e: n == number and set_id(e, unselected))
    code, verdict, _ = check(tmp_path / "unselected")
    assert code == 1 and verdict["unselected_rows"] == 1
    assert any(f"record {number}: step" in v and f"id {unselected} is not a record" in v for v in verdict["violations"])
    # A record with one copy in two rows of one step.
    rows_ = real_rows(tmp_path / "twice")
    (first, step, _), (_, _, other) = next((a, b) for a, b in zip(rows_, rows_[1:]) if a[1] == b[1])
    rewrite_batches(tmp_path / "twice", lambda n, e: n == first and set_id(e, other))
    code, verdict, _ = check(tmp_path / "twice")
    assert code == 1 and f"step {step}: record {other} is in 2 rows, more than its 1 copies" in verdict["violations"]


def test_verify_batches_reports_malformed_examples_without_a_traceback(tmp_path, capsys):
    data = write_records(
        str(tmp_path / "d.jsonl"), [{"id": f"r{i}", "users": [i % 30], "x": float(i)} for i in range(60)]
    )
    assert cli(capsys, "bound", data, tmp_path / "b", "-k", "2", "--runner", "local")[0] == 0
    assert cli(capsys, "batch", tmp_path / "b", data, tmp_path / "out", *BATCH, "--runner", "local")[0] == 0

    def break_rows(number, example):
        if number == 0:
            del example.features.feature["step"]
        elif number == 1:
            example.features.feature["id"].bytes_list.value[0] = b"\xff\xfe"

    rewrite_batches(tmp_path / "out", break_rows)
    check = ("verify-batches", tmp_path / "out", data, "--min-sep", "1", "-k", "2", "--selected", tmp_path / "b")
    code, verdict, _ = cli(capsys, *check)
    assert code == 1
    assert "batches-00000-of-00001.tfrecord record 0: no 'step' feature" in verdict["violations"]
    assert any(
        v.startswith("batches-00000-of-00001.tfrecord record 1: id") and "not UTF-8" in v for v in verdict["violations"]
    )


# --- madp run reads the records with the bound's columns ----------------------------------------


def min_gap_of_people(output, data) -> int:
    """The smallest gap between two distinct steps of one person (the `people` column), read independently."""
    people = {r["id"]: r["people"] for r in map(json.loads, open(data))}
    example_class = _example_class()
    steps: dict = {}
    for payload in read_tfrecord(os.path.join(output, "batches-00000-of-00001.tfrecord")):
        feature = example_class.FromString(payload).features.feature
        if feature["weight"].float_list.value[0] == 1.0:
            for person in people[feature["id"].int64_list.value[0]]:
                steps.setdefault(person, set()).add(feature["step"].int64_list.value[0])
    gaps = [b - a for s in steps.values() for a, b in zip(sorted(s), sorted(s)[1:])]
    return min(gaps)


def test_run_batches_with_the_bounds_users_column(tmp_path, capsys):
    """bound.users_column: people, and a stray `users` column in the records: batch and verify-batches
    must read `people` too, or the run batches other users than it bounded and still exits 0."""
    data = write_records(
        str(tmp_path / "d.jsonl"),
        [{"id": i, "people": [i % 30], "users": [1000 + i], "x": float(i)} for i in range(60)],
    )
    config = {
        "run_dir": str(tmp_path / "run"),
        "input": data,
        "bound": {"max_contributions": 2, "users_column": "people", "runner": "local"},
        "batch": {"steps": 100, "batch_size": 3, "min_sep": 3, "seed": 2, "runner": "local"},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(config))
    code, summary, err = cli(capsys, "run", tmp_path / "job.yaml")
    assert code == 0, err
    assert min_gap_of_people(tmp_path / "run" / "batches", data) >= 3
    # A batch section may repeat the bound's column, not name another.
    config["batch"]["users_column"] = "users"
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(config))
    code, _, err = cli(capsys, "run", tmp_path / "job.yaml")
    assert code == 2 and "config batch.users_column" in err


def test_run_checks_the_batches_against_the_contribution_bound_and_the_selection(tmp_path):
    from madp.jobs.run_config import RunConfig
    from madp.jobs.run_plan import stages_of

    (tmp_path / "caps.csv").write_text("user,capacity\n7,5\n8,1\n")
    config = {
        "run_dir": str(tmp_path / "run"),
        "input": str(tmp_path / "d.jsonl"),
        "bound": {"max_contributions": 2, "capacities": str(tmp_path / "caps.csv"), "id_column": "rid"},
        "batch": {"steps": 10, "batch_size": 5, "id_column": "rid"},
    }
    stages = {stage.name: stage.command for stage in stages_of(RunConfig.from_json(config))}
    verify = stages["verify-batches"]
    assert verify[verify.index("--max-contributions") + 1] == "5"  # the largest capacity, what training assumes
    assert verify[verify.index("--selected") + 1] == str(tmp_path / "run" / "bound")
    for name in ("batch", "verify-batches"):
        assert stages[name][stages[name].index("--id-column") + 1] == "rid"
        assert stages[name][stages[name].index("--users-column") + 1] == "users"
    del config["bound"]
    with pytest.raises(InputError, match="config batch: needs a bound section"):
        stages_of(RunConfig.from_json(config))
