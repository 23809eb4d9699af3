"""`--users-columns from,to,cc`: a record's users are the union of several columns, each a user id or a
list of them (null, "" and [] adding none, a user in two columns counted once). Both engines, the split
readers and the verifiers (which re-derive the union on their own) must see the graph a precomputed
`users` list of the union gives, with the same reject reasons."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from conftest import reseal_selection, write_records

from madp.cli import main
from madp.core.errors import InputError
from madp.core.record_reading import read_file
from madp.core.records import Columns
from madp.core.verify import verify_bound
from madp.tools.data.synthetic import GraphSpec, generate, to_table

EMAIL = Columns(users_columns=("from", "to", "cc"))
UNION = ["--users-columns", "from,to,cc"]
BEAM = ["--runner", "DirectRunner", "--direct_running_mode", "in_memory", "--partitions", "3"]

# Scalars, lists, nulls, empty values and a sender copying itself; and two rows without a usable user.
ROWS = [
    {"id": 1, "from": "a", "to": ["b", "c"], "cc": None},
    {"id": 2, "from": "a", "to": [], "cc": ["a", "d"]},  # a in from and cc: owns it once
    {"id": 3, "from": None, "to": [], "cc": None},  # no user at all: empty_users, as users: []
    {"id": 4, "from": "", "to": ["e"], "cc": []},  # "" adds no user
    {"id": 5, "from": "x", "to": ["e", None], "cc": []},  # a null in a list: null_user, as in users
]


def cli(capsys, *args) -> tuple[int, dict | None, str]:
    code = main(["-q", *map(str, args)])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.strip().startswith("{") else None), err


def email_records(path: str, records: int = 1500, seed: int = 3) -> str:
    """Synthetic records with both a `users` list and from/to/cc whose union it is."""
    write_records(path, to_table(generate(GraphSpec(records=records, seed=seed)), "both").to_pylist())
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_the_union_of_scalars_and_lists_with_the_reasons_of_users(tmp_path, suffix):
    result = read_file(write_records(str(tmp_path / f"r{suffix}"), ROWS), 0, EMAIL)
    users = result.chunk.users.to_pylist()
    offsets = result.chunk.offsets.tolist()
    assert result.chunk.ids.to_pylist() == [1, 2, 4]
    assert [users[a:b] for a, b in zip(offsets, offsets[1:])] == [["a", "b", "c"], ["a", "d"], ["e"]]
    assert result.rejects.reason == ["empty_users", "null_user"]
    assert json.loads(result.rejects.record[0]) == ROWS[2]  # the row as read, its columns as they were
    assert result.repeated_users_removed == 1


def test_rows_json_cannot_type_are_read_one_by_one_with_the_same_rules(tmp_path):
    """A column that is a scalar in one row and a list in another, an object, a boolean: Arrow cannot type
    the file, so each row is judged on its own, with the reasons of `users`."""
    rows = [
        *ROWS,
        {"id": 6, "from": "q", "to": "r", "cc": {"x": 1}},
        {"id": 7, "from": True, "to": "r"},
        {"id": 8, "from": "z", "to": "r", "cc": ""},
    ]
    result = read_file(write_records(str(tmp_path / "r.jsonl"), rows), 0, EMAIL)
    assert result.chunk.ids.to_pylist() == [1, 2, 4, 8]
    assert result.chunk.users.to_pylist()[-2:] == ["z", "r"]
    assert result.rejects.reason == ["empty_users", "null_user", "non_scalar_user", "bad_user_type"]


def test_columns_of_another_type_mixed_ids_and_absent_columns_are_errors(tmp_path):
    table = pa.table({"id": [1, 2], "from": ["a", "b"], "to": [["c"], None], "cc": [1.5, None]})
    pq.write_table(table, tmp_path / "double.parquet")
    with pytest.raises(InputError, match=r"double\.parquet: users column 'cc' \(--users-columns\) has type double"):
        read_file(str(tmp_path / "double.parquet"), 0, EMAIL)
    pq.write_table(table.set_column(3, "cc", pa.array([[7], None])), tmp_path / "mixed.parquet")
    with pytest.raises(InputError, match=r"mixed\.parquet: user ids mix integers and strings"):
        read_file(str(tmp_path / "mixed.parquet"), 0, EMAIL)
    # A column no row of a file has is a misspelt name, not a column of nulls: its users would go unbounded.
    data = write_records(str(tmp_path / "no_cc.jsonl"), [{"id": 1, "from": "a", "to": ["b"]}])
    with pytest.raises(InputError, match=r"no_cc\.jsonl: no column \['cc'\] in any row.*--users-columns"):
        from madp.engines.local_engine import read_input

        read_input(data, EMAIL)
    with pytest.raises(InputError, match="name each column once"):
        Columns(users_columns=("from", "to", "from"))
    with pytest.raises(InputError, match="'id' is also the id or weight column"):
        Columns(users_columns=("from", "id"))


def test_users_column_and_users_columns_are_exclusive(tmp_path, capsys):
    data = write_records(str(tmp_path / "r.jsonl"), ROWS[:2])
    for command in (
        ["bound", data, tmp_path / "b", "-k", "2", "--runner", "local"],
        ["verify-bound", data, tmp_path / "b", "-k", "2"],
        ["recommend-k", data, "--epsilon", "4", "--delta", "1e-5", "--steps", "10", "--batch-size", "2"],
    ):
        code, _, err = cli(capsys, *command, "--users-column", "users", *UNION)
        assert code == 2 and "--users-column users and --users-columns from,to,cc: give one of them" in err
    config = {
        "run_dir": str(tmp_path / "run"),
        "input": data,
        "bound": {"max_contributions": 2, "users_column": "users", "users_columns": ["from", "to", "cc"]},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(config))
    code, _, err = cli(capsys, "run", tmp_path / "job.yaml")
    assert code == 2 and "config bound: --users-column users and --users-columns from,to,cc" in err


def _bound(capsys, data, output, *options) -> dict:
    code, report, err = cli(capsys, "bound", data, output, "-k", "2", *options)
    assert code == 0, err
    return report


def _selection(output) -> bytes:
    return (output / "selected" / "part-00000-of-00001.parquet").read_bytes()


@pytest.mark.beam
def test_local_and_beam_select_what_a_precomputed_union_selects(tmp_path, capsys):
    """One file read whole and in splits on Beam: the same selection and graph digest as `users`."""
    data = email_records(str(tmp_path / "records.jsonl"))
    reference = _bound(capsys, data, tmp_path / "users", "--runner", "local")
    local = _bound(capsys, data, tmp_path / "local", "--runner", "local", *UNION)
    beam = _bound(capsys, data, tmp_path / "beam", *BEAM, "--input-split-bytes", "50000", *UNION)
    assert os.path.getsize(data) > 3 * 50000  # read in several splits
    for report, output in ((local, "local"), (beam, "beam")):
        assert _selection(tmp_path / output) == _selection(tmp_path / "users")
        assert report["graph_digest"] == reference["graph_digest"]
        assert report["parameters"]["users_columns"] == ["from", "to", "cc"]
        assert report["parameters"]["users_column"] is None
        assert report["repeated_users_removed"] == len(range(3, 1500, 8))  # the senders copying themselves
    assert reference["parameters"]["users_columns"] is None


@pytest.mark.beam
def test_batch_reads_the_bounds_columns_and_verify_batches_re_derives_them(tmp_path, capsys):
    directory = tmp_path / "records"
    directory.mkdir()
    data = email_records(str(directory / "part-0.parquet"), records=800)
    _bound(capsys, str(directory), tmp_path / "bound", "--runner", "local", *UNION)
    batch = ["--steps", "40", "--batch-size", "20", "--min-sep", "4", "--seed", "3"]
    for name, engine in (("local", ["--runner", "local"]), ("beam", BEAM)):
        code, _, err = cli(capsys, "batch", tmp_path / "bound", directory, tmp_path / name, *batch, *engine, *UNION)
        assert code == 0, err
        features = set(json.load(open(tmp_path / name / "schema.json"))["features"])
        assert not {"from", "to", "cc"} & features and "users" in features  # `users` is content here, like any other
        code, checked, err = cli(
            capsys, "verify-batches", tmp_path / name, directory, "--min-sep", "4",
            "--selected", tmp_path / "bound", "-k", "2", *UNION,
        )  # fmt: skip
        assert code == 0 and checked["ok"], checked
    assert (tmp_path / "local" / "batches-00000-of-00001.tfrecord").read_bytes() == (
        tmp_path / "beam" / "batches-00000-of-00001.tfrecord"
    ).read_bytes()
    # Another graph (cc left out) is refused, naming the columns the bound read.
    code, _, err = cli(capsys, "batch", tmp_path / "bound", data, tmp_path / "o", *batch, "--runner", "local",
                       "--users-columns", "from,to")  # fmt: skip
    assert code == 2 and "is not the graph SELECTED" in err and "--users-columns from,to,cc" in err


@pytest.mark.slow
def test_recommend_k_sweeps_the_same_graph(tmp_path, capsys):
    data = email_records(str(tmp_path / "records.parquet"), records=500)
    sweep = ["recommend-k", data, *"--epsilon 4 --delta 1e-5 --steps 20 --batch-size 20 --k 2".split()]
    code, by_users, err = cli(capsys, *sweep)
    assert code == 0, err
    code, by_union, err = cli(capsys, *sweep, *UNION)
    assert code == 0, err
    assert by_union["input"] == by_users["input"] and by_union["recommended_k"] == by_users["recommended_k"]


def test_verify_re_derives_users_from_every_column(tmp_path, capsys):
    """User x is only ever in cc: a selection of all three of its records breaks K = 2, and the verifier
    sees it because it reads cc itself, not from the engine."""
    rows = [{"id": i, "from": f"s{i}", "to": [f"t{i}"], "cc": ["x"] if i < 3 else None} for i in range(6)]
    data = write_records(str(tmp_path / "r.parquet"), rows)
    report = _bound(capsys, data, tmp_path / "b", "--runner", "local", *UNION)
    assert report["distinct_selected"] == 5
    assert verify_bound(data, str(tmp_path / "b"), 2, users_columns=("from", "to", "cc"))["ok"]
    every = pa.table({"id": pa.array(range(6), pa.int64()), "copies": pa.array([1] * 6, pa.int64())})
    pq.write_table(every, tmp_path / "b" / "selected" / "part-00000-of-00001.parquet")
    reseal_selection(tmp_path / "b")
    found = verify_bound(data, str(tmp_path / "b"), 2, users_columns=("from", "to", "cc"))
    assert not found["ok"] and found["violations"] == ["user 'x' contributes 3 records, bound 2"]
    # Verifying with other columns than the bound read is itself a violation, never a silent pass.
    code, found, _ = cli(capsys, "verify-bound", data, tmp_path / "b", "-k", "2", "--users-columns", "from,to")
    assert code == 1 and "was bounded with --users-columns from,to,cc, but verify-bound was given" in str(found)


def test_the_generator_keeps_its_default_and_writes_an_email_export(tmp_path):
    data = generate(GraphSpec(records=400, seed=2, task="text"))
    default = to_table(data)
    assert default.column_names == ["id", "users", "text", "label"] and default.equals(to_table(data, "users"))
    email = to_table(data, "from-to-cc")
    assert email.column_names == ["id", "from", "to", "cc", "text", "label"]
    for row, users in zip(email.to_pylist(), default.column("users").to_pylist()):
        union = [row["from"], *row["to"], *(row["cc"] or [])]
        assert set(union) == set(users) and (row["cc"] is None or row["cc"])


def test_audit_canaries_are_written_in_the_users_columns(tmp_path):
    """An audit of a job bounded with users_columns plants canary users the bound sees: all in the first
    column (a list), the others null."""
    import numpy as np

    from madp.jobs.audit import plant
    from madp.tools.planning.audit_config import AuditOptions

    data = write_records(
        str(tmp_path / "r.parquet"), to_table(generate(GraphSpec(records=300)), "from-to-cc").to_pylist()
    )
    canaries = plant([data], EMAIL, "features", "label", AuditOptions(canaries=10), np.random.default_rng(1))
    pq.write_table(canaries.table, tmp_path / "canaries.parquet")
    read = read_file(str(tmp_path / "canaries.parquet"), 1, EMAIL)
    assert len(read.chunk) == len(canaries.record_ids) and not read.rejects.reason
    assert set(read.chunk.users.to_pylist()) == set(canaries.users)


@pytest.mark.tf
def test_run_config_with_users_columns_end_to_end(tmp_path, capsys):
    """An email export (from, to, cc) from the generator through bound, batch, both verifiers,
    calibration and training, with no `users` column anywhere."""
    config = {
        "run_dir": str(tmp_path / "run"),
        "generate": {"records": 600, "users_as": "from-to-cc", "task": "text", "seed": 1, "holdout": True},
        "bound": {"max_contributions": 2, "users_columns": ["from", "to", "cc"], "runner": "local"},
        "batch": {"steps": 30, "batch_size": 15, "min_sep": 1, "seed": 2, "runner": "local"},
        "calibrate": {"noise_multiplier": 1.0, "delta": 1.0e-5},
        "train": {"model": "text-classifier", "labels": ["business", "science", "sports", "travel"], "noise_seed": 1},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(config))
    code, summary, err = cli(capsys, "run", tmp_path / "job.yaml")
    assert code == 0, err
    assert [s["stage"] for s in summary["stages"] if s["status"] == "ran"][-2:] == ["calibrate", "train"]
    report = json.load(open(tmp_path / "run" / "bound" / "report.json"))
    assert report["parameters"]["users_columns"] == ["from", "to", "cc"] and report["rejected_total"] == 0
    schema = json.load(open(tmp_path / "run" / "batches" / "schema.json"))["features"]
    assert {"text", "label"} <= set(schema) and not {"from", "to", "cc", "users"} & set(schema)


def test_a_run_reads_and_verifies_with_the_bounds_users_columns(tmp_path):
    """verify-bound, batch and verify-batches get the bound's --users-columns; a batch section may repeat
    them, not name others."""
    from madp.jobs.run_config import RunConfig
    from madp.jobs.run_plan import stages_of

    config = {
        "run_dir": str(tmp_path / "run"),
        "input": str(tmp_path / "records"),
        "bound": {"max_contributions": 2, "users_columns": ["from", "to", "cc"]},
        "batch": {"steps": 30, "batch_size": 15, "users_columns": "from,to,cc"},
    }
    stages = {stage.name: stage.command for stage in stages_of(RunConfig.from_json(dict(config)))}
    for name in ("bound", "verify-bound", "batch", "verify-batches"):
        assert stages[name][stages[name].index("--users-columns") + 1] == "from,to,cc"
        assert "--users-column" not in stages[name]
    config["batch"] = {**config["batch"], "users_columns": ["from", "to"]}
    with pytest.raises(InputError, match=r"config batch.users_columns: differs from the bound's \('from,to,cc'\)"):
        stages_of(RunConfig.from_json(dict(config)))
    config["batch"] = {"steps": 30, "batch_size": 15, "users_column": "users"}
    with pytest.raises(InputError, match="config batch.users_column: the bound reads the users with users_columns"):
        stages_of(RunConfig.from_json(dict(config)))
