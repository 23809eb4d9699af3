"""Batch materialization: the sampler kernels against brute force, the batches through the
independent verifier, batch-size calibration, engines agreeing byte for byte, truncation and
padding, the greedy sampler, and clear errors."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import reseal_selection, write_records

from madp.beam.batch import run_beam
from madp.core import sampling
from madp.core.errors import InputError
from madp.core.selection import BoundOptions
from madp.core.verify import read_tfrecord, verify_batches
from madp.core.verify.tfrecords import _example_class, _feature_values
from madp.engines.batch_local import run_local
from madp.engines.batching import BatchOptions
from madp.engines.local_engine import run_local as bound_local

BEAM = ["--runner", "DirectRunner", "--direct_running_mode", "in_memory"]


def bounded(tmp_path, rows, k=3, name="data.jsonl"):
    data = write_records(str(tmp_path / name), rows)
    bound_local(data, str(tmp_path / "bounded"), BoundOptions(max_contributions=k))
    return str(tmp_path / "bounded"), data


def bound_of(selected) -> dict:
    """What verify-batches checks the batches against: the selection and its contribution bound."""
    return {
        "selected": selected,
        "max_contributions": json.load(open(os.path.join(selected, "report.json")))["contribution_bound"],
    }


def batch_files(output) -> dict[str, bytes]:
    return {
        n: open(os.path.join(output, n), "rb").read() for n in sorted(os.listdir(output)) if n.endswith(".tfrecord")
    }


def rows_of(output) -> list[dict]:
    example = _example_class()
    rows = []
    for name in sorted(os.listdir(output)):
        if name.endswith(".tfrecord"):
            for payload in read_tfrecord(os.path.join(output, name)):
                parsed = example.FromString(payload)
                rows.append({k: _feature_values(parsed, k) for k in parsed.features.feature})
    return rows


@pytest.fixture
def graph_data(tmp_path, small_graph):
    rng = np.random.default_rng(3)
    rows = [dict(r, x=rng.normal(size=3).tolist(), label=int(i % 2), tag=f"t{i}") for i, r in enumerate(small_graph)]
    return bounded(tmp_path, rows)


# --- kernels ------------------------------------------------------------------------------------


def test_blocked_user_steps_matches_brute_force():
    rng = np.random.default_rng(0)
    users = rng.integers(0, 5, 400).astype(np.uint64)
    steps = rng.integers(0, 60, 400)
    for min_sep in (1, 2, 4, 9):
        blocked = sampling.blocked_user_steps(users, steps, min_sep)
        expected = [any(u2 == u and s - min_sep < s2 < s for u2, s2 in zip(users, steps)) for u, s in zip(users, steps)]
        assert blocked.tolist() == expected


def test_sampled_steps_are_bernoulli_and_counter_based():
    keys = np.arange(20000, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    unit, step = sampling.sampled_steps(keys, 0.01, 300)
    assert len(np.unique(unit * 300 + step)) == len(unit)
    per_step = np.bincount(step, minlength=300) / len(keys)
    assert abs(per_step.mean() - 0.01) < 0.0005
    # A unit's steps depend on its key only: sampling a subset gives the same steps for it.
    sub_unit, sub_step = sampling.sampled_steps(keys[::7], 0.01, 300)
    full = set(zip(unit[unit % 7 == 0] // 7, step[unit % 7 == 0]))
    assert set(zip(sub_unit, sub_step)) == full


def test_neighbourhood_sizes_match_brute_force():
    rng = np.random.default_rng(1)
    record = np.repeat(np.arange(300), rng.integers(1, 4, 300))
    user = rng.integers(0, 80, len(record))
    copies = rng.integers(1, 3, 300)
    users_of = [set(user[record == r]) for r in range(300)]
    expected = [sum(copies[o] for o in range(300) if users_of[o] & users_of[r]) for r in range(300)]
    assert sampling.neighbourhood_sizes(record, user, copies).tolist() == expected
    chunked = np.zeros(300, np.int64)
    for owner, neighbour in sampling.neighbour_pairs(record, user, max_pairs=50):
        chunked += np.bincount(owner, weights=copies[neighbour], minlength=300).astype(np.int64)
    assert chunked.tolist() == expected
    # The partitioned form: pairs formed in several user partitions (so repeated), shuffled.
    by_partition = [list(sampling.neighbour_pairs(record[user % 3 == k], user[user % 3 == k])) for k in range(3)]
    owner, neighbour = (np.concatenate([p[i] for pairs in by_partition for p in pairs]) for i in range(2))
    shuffle = rng.permutation(len(owner))
    owner, neighbour = owner[shuffle], neighbour[shuffle]
    sizes, units = sampling.neighbourhood_sizes_of_pairs(owner, neighbour, copies[neighbour])
    present = np.unique(owner)
    assert present.tolist() == list(range(300))
    assert sizes.tolist() == expected
    assert units.tolist() == copies.tolist()


def test_calibrated_probability_hits_target_and_rejects_unreachable():
    sizes, counts = np.array([1, 2, 5]), np.array([1000, 500, 200])
    p = sampling.calibrate_probability(120.0, sizes, counts, 4)
    assert sampling.expected_batch_size(p, sizes, counts, 4) == pytest.approx(120.0, rel=1e-8)
    assert sampling.calibrate_probability(170.0, sizes, counts, 1) == pytest.approx(0.1)
    with pytest.raises(InputError, match="unreachable"):
        sampling.calibrate_probability(1500.0, sizes, counts, 4)


# --- b-min-sep sampling end to end -------------------------------------------------------------


@pytest.mark.slow
def test_minsep_batches_pass_the_verifier_and_hit_the_target(tmp_path, graph_data):
    selected, data = graph_data
    report = run_local(
        selected, data, str(tmp_path / "out"), BatchOptions(seed=0, steps=1500, batch_size=40, min_sep=5)
    )
    assert abs(report.batch_sizes.mean / 40 - 1) < 0.02
    assert abs(report.relative_error_to_target) < 0.02
    assert len(report.warm_up_batch_sizes) == 4 and len(report.batch_sizes.per_step) == 1500
    check = verify_batches(str(tmp_path / "out"), data, **bound_of(selected), min_sep=5)
    assert check["ok"], check["violations"]
    assert check["min_gap"] >= 5 and check["min_gap"] == report.participation.min_gap
    assert check["max_participations"] == report.participation.max_participations
    assert check["real_rows"] == sum(report.batch_sizes.per_step)
    # The same batches checked against a larger min-sep, a participation bound or a batch bound fail.
    assert not verify_batches(str(tmp_path / "out"), data, **bound_of(selected), min_sep=50)["ok"]
    too_few = verify_batches(str(tmp_path / "out"), data, **bound_of(selected), min_sep=5, max_participations=1)
    assert not too_few["ok"] and "participates in" in too_few["violations"][0]
    assert not verify_batches(str(tmp_path / "out"), data, **bound_of(selected), min_sep=5, max_batch_size=20)["ok"]


def test_features_and_schema(tmp_path, graph_data):
    selected, data = graph_data
    run_local(selected, data, str(tmp_path / "out"), BatchOptions(seed=0, steps=20, batch_size=30, min_sep=2))
    schema = json.load(open(tmp_path / "out" / "schema.json"))["features"]
    assert schema["x"] == {"dtype": "float", "shape": [3]} and schema["label"]["dtype"] == "int64"
    assert schema["tag"]["dtype"] == "bytes" and schema["step"]["dtype"] == "int64"
    source = {json.loads(line)["id"]: json.loads(line) for line in open(data)}
    rows = rows_of(str(tmp_path / "out"))
    assert [r["step"][0] for r in rows] == sorted(r["step"][0] for r in rows)
    for row in rows[:50]:
        record = source[row["id"][0]]
        assert row["x"] == pytest.approx(record["x"], rel=1e-6) and row["label"] == [record["label"]]
        assert row["tag"] == [record["tag"].encode()] and row["weight"] == [1.0]


@pytest.mark.slow
def test_isolated_record_is_included_with_its_stationary_probability(tmp_path):
    # Records with a user of their own: included iff sampled and not sampled in the b-1 steps before,
    # p (1-p)^(b-1) -- p itself for b = 1.
    rows = [{"id": i, "users": [i]} for i in range(400)]
    selected, data = bounded(tmp_path, rows, k=1)
    for min_sep in (1, 3):
        out = str(tmp_path / f"out{min_sep}")
        report = run_local(selected, data, out, BatchOptions(seed=0, steps=3000, batch_size=20, min_sep=min_sep))
        p = report.sampling_probability
        inclusion = report.batch_sizes.mean / 400
        assert inclusion == pytest.approx(p * (1 - p) ** (min_sep - 1), rel=0.02)
        assert verify_batches(out, data, **bound_of(selected), min_sep=min_sep)["ok"]


def test_copies_are_distinct_units(tmp_path):
    rows = [{"id": i, "users": [i]} for i in range(50)]
    selected, data = bounded(tmp_path, rows, k=1)
    path = os.path.join(selected, "selected", "part-00000-of-00001.parquet")
    table = pq.read_table(path)
    pq.write_table(table.set_column(1, "copies", pa.array([3] * len(table), pa.int64())), path)
    reseal_selection(selected)
    report = run_local(selected, data, str(tmp_path / "out"), BatchOptions(seed=0, steps=2000, batch_size=15))
    assert report.units == 150 and report.sampling_probability == pytest.approx(0.1)
    # With min-sep 1 the 3 copies of a record are sampled independently: sometimes together in a step.
    assert report.participation.user_rows_sharing_a_step > 0


@pytest.mark.beam
def test_identical_output_across_engines_partitions_shards_and_reruns(tmp_path, graph_data):
    selected, data = graph_data
    options = BatchOptions(steps=60, batch_size=40, min_sep=3, max_batch_size=45, output_shards=3, seed=5)
    local = run_local(selected, data, str(tmp_path / "local"), options)
    expected = batch_files(str(tmp_path / "local"))
    assert len(expected) == 3
    run_local(selected, data, str(tmp_path / "again"), options)
    assert batch_files(str(tmp_path / "again")) == expected
    for partitions, args in (
        (1, BEAM),
        (3, BEAM),
        (4, ["--runner", "DirectRunner", "--direct_running_mode", "multi_processing"]),
    ):
        out = str(tmp_path / f"beam{partitions}")
        beam = run_beam(selected, data, out, options, [*args, f"--partitions={partitions}"])
        assert batch_files(out) == expected, partitions
        assert open(os.path.join(out, "schema.json")).read() == open(tmp_path / "local" / "schema.json").read()
        for field in (
            "sampling_probability",
            "batch_sizes",
            "written_batch_sizes",
            "participation",
            "records_never_written",
            "truncated_rows",
            "padding_rows",
            "units",
            "records",
        ):
            assert getattr(beam, field) == getattr(local, field), field
    other_seed = run_local(
        selected,
        data,
        str(tmp_path / "seed6"),
        BatchOptions(steps=60, batch_size=40, min_sep=3, max_batch_size=45, output_shards=3, seed=6),
    )
    assert (
        batch_files(str(tmp_path / "seed6")) != expected
        and other_seed.sampling_probability == local.sampling_probability
    )


@pytest.mark.beam
def test_resharded_input_gives_the_same_batches(tmp_path, small_graph):
    selected, data = bounded(tmp_path, small_graph)
    directory = tmp_path / "sharded"
    directory.mkdir()
    for shard, start in enumerate(range(0, len(small_graph), 700)):
        write_records(str(directory / f"part-{shard}.parquet"), small_graph[start : start + 700])
    options = BatchOptions(seed=0, steps=40, batch_size=30, min_sep=2)
    run_local(selected, data, str(tmp_path / "a"), options)
    run_beam(selected, str(directory), str(tmp_path / "b"), options, [*BEAM, "--partitions=2"])
    assert batch_files(str(tmp_path / "a")) == batch_files(str(tmp_path / "b"))


def test_truncation_and_padding_give_exactly_max_batch_size_rows(tmp_path, graph_data):
    selected, data = graph_data
    out = str(tmp_path / "out")
    report = run_local(
        selected, data, out, BatchOptions(seed=0, steps=200, batch_size=40, min_sep=2, max_batch_size=40)
    )
    rows = rows_of(out)
    per_step: dict = {}
    for row in rows:
        per_step.setdefault(row["step"][0], []).append(row)
    assert sorted(per_step) == list(range(200))
    sampled = report.batch_sizes.per_step
    for step, step_rows in per_step.items():
        weights = [r["weight"][0] for r in step_rows]
        assert len(step_rows) == 40
        assert weights.count(1.0) == min(sampled[step], 40)
        assert weights == sorted(weights, reverse=True), "padding after the real rows"
        padding = [r for r in step_rows if r["weight"] == [0.0]]
        assert all(r["x"] == [0.0, 0.0, 0.0] and r["label"] == [0] and r["tag"] == [b""] for r in padding)
    assert report.truncated_rows == sum(max(0, s - 40) for s in sampled) > 0
    assert report.padding_rows == sum(max(0, 40 - s) for s in sampled) > 0
    assert verify_batches(out, data, **bound_of(selected), min_sep=2, max_batch_size=40)["ok"]


def test_truncated_record_still_excludes_its_neighbours(tmp_path):
    # One user owns every record: a batch of several is truncated to one row, and the other
    # sampled records still count as sampled, so the next b-1 steps hold nobody.
    rows = [{"id": i, "users": [0, 1000 + i]} for i in range(30)]
    selected, data = bounded(tmp_path, rows, k=30)
    out = str(tmp_path / "out")
    report = run_local(
        selected, data, out, BatchOptions(seed=0, steps=3000, batch_size=0.17, min_sep=3, max_batch_size=1)
    )
    assert report.truncated_rows > 0
    check = verify_batches(out, data, **bound_of(selected), min_sep=3, max_batch_size=1)
    assert check["ok"], check["violations"]


# --- greedy -------------------------------------------------------------------------------------


def test_greedy_batches_have_exactly_b_records_and_its_k_matches_the_verifier(tmp_path, graph_data):
    selected, data = graph_data
    out = str(tmp_path / "out")
    report = run_local(
        selected, data, out, BatchOptions(seed=0, steps=100, batch_size=50, sampler="minsep-greedy", min_sep=6)
    )
    assert report.batch_sizes.min == report.batch_sizes.max == 50
    check = verify_batches(out, data, **bound_of(selected), min_sep=6, max_participations=report.k)
    assert check["ok"], check["violations"]
    assert check["max_participations"] == report.k <= -(-100 // 6)
    assert check["user_rows_sharing_a_step"] == 0


@pytest.mark.slow
def test_find_max_min_sep_is_the_last_feasible(tmp_path, graph_data):
    selected, data = graph_data
    options = dict(steps=60, batch_size=200, sampler="minsep-greedy")
    report = run_local(selected, data, str(tmp_path / "out"), BatchOptions(seed=0, find_max_min_sep=True, **options))
    best = report.parameters.min_sep
    assert 1 < best < 60 and report.min_sep_search[-1] == {"min_sep": best + 1, "feasible": False}
    assert verify_batches(str(tmp_path / "out"), data, **bound_of(selected), min_sep=best)["ok"]
    with pytest.raises(InputError, match="no solution .* cannot be filled"):
        run_local(selected, data, str(tmp_path / "x"), BatchOptions(seed=0, min_sep=best + 1, **options))


# --- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(steps=0, batch_size=5), "^steps must be at least 1"),
        (dict(steps=5, batch_size=5, min_sep=0), "^min_sep must be at least 1"),
        (dict(steps=5, batch_size=0), "^batch_size must be positive"),
        (dict(steps=5, batch_size=2.5, sampler="minsep-greedy"), "must be an integer"),
        (dict(steps=5, batch_size=5, find_max_min_sep=True), "applies to sampler minsep-greedy"),
        (dict(steps=5, batch_size=5, max_batch_size=0), "^max_batch_size must be at least 1"),
    ],
)
def test_bad_options_are_refused(options, message):
    with pytest.raises(InputError, match=message):
        BatchOptions(seed=0, **options)


def test_infeasible_inputs_give_clear_errors(tmp_path, graph_data):
    selected, data = graph_data
    out = str(tmp_path / "out")
    with pytest.raises(InputError, match=r"must be in \(0, \d+\]"):
        run_local(selected, data, out, BatchOptions(seed=0, steps=5, batch_size=10**7))
    with pytest.raises(InputError, match="larger than the"):
        run_local(selected, data, out, BatchOptions(seed=0, steps=5, batch_size=10**7, sampler="minsep-greedy"))
    with pytest.raises(InputError, match="unreachable"):
        run_local(selected, data, out, BatchOptions(seed=0, steps=5, batch_size=1500, min_sep=50))
    with pytest.raises(InputError, match="not a finished `madp bound` output"):
        run_local(str(tmp_path), data, out, BatchOptions(seed=0, steps=5, batch_size=5))
    with pytest.raises(InputError, match="batch feature"):
        run_local(selected, data, out, BatchOptions(seed=0, steps=5, batch_size=5, content_columns=("x", "id")))
    assert not os.path.exists(out) or not batch_files(out)


@pytest.mark.beam
def test_selected_ids_missing_from_data_are_an_error(tmp_path, small_graph):
    selected, _ = bounded(tmp_path, small_graph)
    other = write_records(str(tmp_path / "other.jsonl"), small_graph[:100])
    with pytest.raises(InputError, match="selected ids are not valid records"):
        run_local(selected, other, str(tmp_path / "out"), BatchOptions(seed=0, steps=5, batch_size=5))
    with pytest.raises(InputError, match="selected ids are not valid records"):
        run_beam(selected, other, str(tmp_path / "out"), BatchOptions(seed=0, steps=5, batch_size=5), BEAM)


def test_null_content_is_an_error_naming_the_record(tmp_path):
    rows = [{"id": i, "users": [i], "x": (None if i == 7 else 1.0)} for i in range(20)]
    selected, data = bounded(tmp_path, rows, k=1)
    with pytest.raises(InputError, match="'x' is null.* record 7"):
        run_local(selected, data, str(tmp_path / "out"), BatchOptions(seed=0, steps=5, batch_size=5))
    report = run_local(
        selected, data, str(tmp_path / "out"), BatchOptions(seed=0, steps=5, batch_size=5, content_columns=())
    )
    assert report.parameters.content_columns == ()


def test_invalid_rows_are_skipped_and_written_out(tmp_path):
    rows = [{"id": i, "users": [i]} for i in range(20)] + [{"id": 99, "users": []}]
    data = write_records(str(tmp_path / "data.jsonl"), rows)
    bound_local(data, str(tmp_path / "bounded"), BoundOptions(max_contributions=1, on_invalid="skip"))
    with pytest.raises(InputError, match="empty_users"):
        run_local(str(tmp_path / "bounded"), data, str(tmp_path / "out"), BatchOptions(seed=0, steps=5, batch_size=5))
    report = run_local(
        str(tmp_path / "bounded"),
        data,
        str(tmp_path / "out"),
        BatchOptions(seed=0, steps=5, batch_size=5, on_invalid="skip"),
    )
    assert report.rejected == {"empty_users": 1}
    assert json.loads(open(tmp_path / "out" / "rejected" / "rejected.jsonl").readline())["record"]["id"] == 99


def test_cli_batch_and_verify_batches_exit_codes(tmp_path, graph_data, capsys):
    from madp.cli import main

    selected, data = graph_data
    out = str(tmp_path / "out")
    assert (
        main(
            [
                "-q",
                "batch",
                selected,
                data,
                out,
                "--steps",
                "50",
                "--batch-size",
                "30",
                "--min-sep",
                "4",
                "--runner",
                "local",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert report["engine"] == "local" and "per_step" not in report["batch_sizes"]
    assert main(["-q", "verify-batches", out, data, "--min-sep", "4", "--selected", selected, "-k", "3"]) == 0
    capsys.readouterr()
    assert main(["-q", "verify-batches", out, data, "--min-sep", "40", "--selected", selected, "-k", "3"]) == 1
    assert "apart (< min-sep 40)" in json.loads(capsys.readouterr().out)["violations"][0]
    assert (
        main(
            [
                "-q",
                "batch",
                selected,
                data,
                out,
                "--steps",
                "5",
                "--batch-size",
                "5",
                "--min-sep",
                "0",
                "--runner",
                "local",
            ]
        )
        == 2
    )
    assert "--min-sep must be at least 1" in capsys.readouterr().err


@pytest.mark.slow
def test_wide_rows_are_encoded_in_chunks_with_the_same_bytes(graph_data, tmp_path, monkeypatch):
    """Rows are encoded in chunks of about _ENCODE_BYTES (the encoder's index arrays cost 16 bytes per byte):
    a chunk smaller than one row gives the same files byte for byte, and the rows parse."""
    from madp.core import batch_files as files_module

    selected, data = graph_data
    options = BatchOptions(seed=0, steps=30, batch_size=8, min_sep=2)
    run_local(selected, data, str(tmp_path / "whole"), options)
    monkeypatch.setattr(files_module, "_ENCODE_BYTES", 7)
    run_local(selected, data, str(tmp_path / "chunks"), options)
    assert batch_files(tmp_path / "chunks") == batch_files(tmp_path / "whole") != {}
    assert len(rows_of(tmp_path / "chunks")) == len(rows_of(tmp_path / "whole")) > 0
