"""The Beam pipeline and the local engine write identical outputs, whatever the partitioning."""

from __future__ import annotations

import json
import os

import pytest
from conftest import write_records

from madp.beam.bound import run_beam
from madp.core.selection import BoundOptions
from madp.core.verify import verify_bound
from madp.engines.local_engine import run_local

pytestmark = [pytest.mark.beam]

SAME_REPORT_FIELDS = (
    "input_rows",
    "input_records",
    "input_users",
    "selected_records",
    "distinct_selected",
    "max_user_contribution",
    "rounds",
    "passes",
    "converged",
    "per_round",
    "rejected",
    "rejected_total",
    "repeated_users_removed",
    "histograms",
)


def selection_files(output: str) -> dict[str, bytes]:
    directory = os.path.join(output, "selected")
    return {name: open(os.path.join(directory, name), "rb").read() for name in sorted(os.listdir(directory))}


def assert_same(tmp_path, input_path, options, beam_args):
    local = run_local(input_path, str(tmp_path / "local"), options)
    beam = run_beam(input_path, str(tmp_path / "beam"), options, beam_args)
    for field in SAME_REPORT_FIELDS:
        assert getattr(local, field) == getattr(beam, field), field
    assert selection_files(str(tmp_path / "local")) == selection_files(str(tmp_path / "beam"))
    assert not os.path.exists(tmp_path / "beam" / "_work" / "state"), "work files are cleaned up"
    return local, beam


@pytest.fixture
def sharded_input(tmp_path, small_graph):
    directory = tmp_path / "input"
    directory.mkdir()
    for shard, start in enumerate(range(0, len(small_graph), 1000)):
        write_records(str(directory / f"part-{shard}.parquet"), small_graph[start : start + 1000])
    return str(directory)


def test_default_direct_runner_two_workers(tmp_path, sharded_input):
    """By default a graph this small is finished by one worker right after it is built: one run."""
    local, beam = assert_same(tmp_path, sharded_input, BoundOptions(max_contributions=2), [])
    assert beam.converged and beam.rounds >= 2 and beam.engine == "DirectRunner"
    (run,) = beam.pipeline_runs
    assert run["finished_locally_incidences"] == run["iterations"][0]["active_incidences"] > 0
    for name in ("input_rows", "input_records", "input_users", "selected_records", "distinct_selected"):
        assert run["beam_counters"][name] == getattr(beam, name), name
    assert verify_bound(sharded_input, str(tmp_path / "beam"), 2)["ok"]


def test_rounds_in_the_graph_carry_only_undecided_incidences(tmp_path, sharded_input):
    """With no local finish, every round runs in the graph, in one pipeline run: the state shrinks
    to the undecided incidences, and the counters match the report's rounds."""
    args = ["--local-finish-incidences=0", "--partitions=6"]
    local, beam = assert_same(tmp_path, sharded_input, BoundOptions(max_contributions=2), args)
    (run,) = beam.pipeline_runs
    assert run["finished_locally_incidences"] is None
    active = [one["active_incidences"] for one in run["iterations"]]
    assert active[0] > active[1] > active[2] and active[len(beam.per_round)] == 0, active
    shuffled = [one["shuffled_bytes"] for one in run["iterations"]]
    assert shuffled[2] < 0.2 * shuffled[1], shuffled
    counters = run["beam_counters"]
    for index, one in enumerate(beam.per_round, 1):
        assert counters[f"round_{index:05d}_selected"] == one.selected


def test_duplicates_chained_pipelines_in_memory(tmp_path, sharded_input):
    options = BoundOptions(max_contributions=3, duplicates=True)
    local, beam = assert_same(
        tmp_path,
        sharded_input,
        options,
        ["--direct_running_mode=in_memory", "--partitions=3", "--rounds-per-pipeline=2", "--local-finish-incidences=0"],
    )
    assert local.passes > 1 and local.selected_records > local.distinct_selected
    assert len(beam.pipeline_runs) > 1


def test_string_ids_weights_capacities_one_partition_sharded_output(tmp_path, small_graph):
    rows = [
        {"id": f"doc-{r['id']}", "users": [f"u{u}" for u in r["users"]], "body": "x", "w": r["id"] % 5}
        for r in small_graph
    ]
    input_path = write_records(str(tmp_path / "records.jsonl"), rows)
    capacities = tmp_path / "capacities.csv"
    capacities.write_text("user,capacity\n" + "".join(f"u{u},{u % 4}\n" for u in range(0, 400, 3)))
    options = BoundOptions(
        max_contributions=2, capacities=str(capacities), output_shards=3, order="weight", weight_column="w"
    )
    assert_same(tmp_path, input_path, options, ["--direct_num_workers=1", "--partitions=1"])
    assert verify_bound(input_path, str(tmp_path / "beam"), 2, str(capacities))["ok"]


def test_max_rounds_across_pipeline_runs(tmp_path, sharded_input):
    local, _ = assert_same(
        tmp_path,
        sharded_input,
        BoundOptions(max_contributions=2, max_rounds=2),
        ["--partitions=2", "--rounds-per-pipeline=1", "--local-finish-incidences=0"],
    )
    assert local.rounds == 2 and not local.converged


def test_invalid_rows_skipped_alike(tmp_path, small_graph):
    rows = small_graph[:500] + [{"id": 1, "users": [5]}, {"id": 9999, "users": []}, {"id": None, "users": [1]}]
    input_path = write_records(str(tmp_path / "bad.jsonl"), rows)
    options = BoundOptions(max_contributions=2, on_invalid="skip")
    local, _ = assert_same(tmp_path, input_path, options, ["--partitions=2"])
    assert local.rejected == {"missing_id": 1, "empty_users": 1, "duplicate_id": 2}
    assert (
        open(tmp_path / "local" / "rejected" / "rejected.jsonl").read()
        == open(tmp_path / "beam" / "rejected" / "rejected.jsonl").read()
    )


def test_resharded_input_gives_same_selection(tmp_path, small_graph, sharded_input):
    one_file = write_records(str(tmp_path / "all.parquet"), small_graph)
    run_local(one_file, str(tmp_path / "one"), BoundOptions(max_contributions=2))
    run_local(sharded_input, str(tmp_path / "many"), BoundOptions(max_contributions=2))
    assert selection_files(str(tmp_path / "one")) == selection_files(str(tmp_path / "many"))
    report = json.load(open(tmp_path / "one" / "report.json"))
    assert report["selected_records"] > 0


def test_beam_error_removes_only_its_own_outputs(tmp_path):
    from madp.core.errors import InputError

    input_path = write_records(str(tmp_path / "bad.jsonl"), [{"id": 1, "users": [1]}, {"id": 2, "users": []}])
    output = tmp_path / "out"
    output.mkdir()
    (output / "notes.txt").write_text("the user's own file")
    with pytest.raises(InputError, match="row 1: empty_users"):
        run_beam(input_path, str(output), BoundOptions(max_contributions=1), ["--direct_running_mode=in_memory"])
    assert (output / "notes.txt").read_text() == "the user's own file"
    assert not (output / "report.json").exists()
    assert not [f for d in ("_work", "rejected", "selected") if (output / d).exists() for f in (output / d).iterdir()]


def test_second_beam_run_into_same_output(tmp_path, small_graph):
    """A second run into the same OUTPUT gives the result of its own input alone."""
    first = write_records(str(tmp_path / "first.parquet"), small_graph)
    second = write_records(str(tmp_path / "second.parquet"), small_graph[: len(small_graph) // 2])
    args = ["--direct_running_mode=in_memory", "--direct_num_workers=1"]
    run_beam(first, str(tmp_path / "out"), BoundOptions(max_contributions=2), args)
    again = run_beam(second, str(tmp_path / "out"), BoundOptions(max_contributions=2), args)
    expected = run_local(second, str(tmp_path / "local"), BoundOptions(max_contributions=2))
    assert again.selected_records == expected.selected_records
    assert selection_files(str(tmp_path / "out")) == selection_files(str(tmp_path / "local"))


def test_capacities_for_users_without_records(tmp_path):
    input_path = write_records(
        str(tmp_path / "tiny.jsonl"), [{"id": 1, "users": [1]}, {"id": 2, "users": [1, 2]}, {"id": 3, "users": [2]}]
    )
    capacities = tmp_path / "caps.csv"
    capacities.write_text("user,capacity\n" + "".join(f"{u},1\n" for u in range(1, 200)))
    options = BoundOptions(max_contributions=2, capacities=str(capacities))
    local, _ = assert_same(tmp_path, input_path, options, ["--direct_running_mode=in_memory", "--partitions=8"])
    assert local.selected_records == 2


def test_input_error_inside_a_worker_reads_clearly(tmp_path):
    from madp.core.errors import InputError

    write_records(str(tmp_path / "a.jsonl"), [{"id": 1, "users": [1]}])
    write_records(str(tmp_path / "b.jsonl"), [{"id": "x", "users": [2]}])
    with pytest.raises(InputError, match=r"^record ids mix integers and strings across input files"):
        run_beam(
            str(tmp_path),
            str(tmp_path / "out"),
            BoundOptions(max_contributions=1),
            ["--direct_running_mode=in_memory", "--partitions=1"],
        )


def test_alternate_order_counts_groups_alike(tmp_path, sharded_input):
    """Beam counts the two groups in a first run; both engines then use the same universal order."""
    options = BoundOptions(max_contributions=2, order="alternate", arity_threshold=1, small_run=30, large_run=10)
    local, beam = assert_same(tmp_path, sharded_input, options, ["--direct_running_mode=in_memory", "--partitions=3"])
    assert local.parameters.group_sizes == beam.parameters.group_sizes
    assert sum(local.parameters.group_sizes) == local.input_records


def test_runs_continued_then_finished_locally_with_duplicates_and_capacities(tmp_path, small_graph):
    """Passes, capacities of 0, pipeline runs continued from a partial selection and the local
    finish taking over part way: the same selection and rounds as in memory."""
    input_path = write_records(str(tmp_path / "records.jsonl"), small_graph[:2000])
    capacities = tmp_path / "capacities.csv"
    capacities.write_text("user,capacity\n" + "".join(f"{u},{u % 3}\n" for u in range(0, 400, 2)))
    options = BoundOptions(max_contributions=3, duplicates=True, capacities=str(capacities))
    args = ["--partitions=4", "--rounds-per-pipeline=2", "--local-finish-incidences=1000"]
    _, beam = assert_same(tmp_path, input_path, options, args)
    runs = beam.pipeline_runs
    assert len(runs) > 1 and runs[-1]["finished_locally_incidences"] is not None
    assert all(run["finished_locally_incidences"] is None for run in runs[:-1])


@pytest.mark.parametrize("order", ["arity", "hash"])
def test_a_hot_user_sends_its_partition_a_few_incidences_per_record_partition(tmp_path, small_graph, order):
    """User -1 owns 1,200 records, half alone: each record partition drops the records the saturation
    certificate rejects on its own records before they travel, so the hot user's partition gets a few
    of its incidences per record partition, and both engines still agree (selection, rounds, users,
    histograms of the input and the selection)."""
    rows = [dict(row) for row in small_graph]
    for index, row in enumerate(rows[:1200]):
        row["users"] = [-1] if index % 2 else [-1, *row["users"]]
    input_path = write_records(str(tmp_path / "records.parquet"), rows)
    partitions, k = 4, 2
    options = BoundOptions(max_contributions=k, order=order)
    local, beam = assert_same(tmp_path, input_path, options, [f"--partitions={partitions}"])
    (run,) = beam.pipeline_runs
    incidences = sum(len(row["users"]) for row in rows)
    # the hot user's records up to its k-th alone one, per record partition: k with --order arity
    # (records alone come first), about 2 k with --order hash (every other record is alone)
    hot_kept_at_most = partitions * 4 * k
    assert run["certified_dropped_records"] >= 1200 - hot_kept_at_most
    assert run["built_incidences"] <= incidences - (1200 - hot_kept_at_most)
    assert local.histograms.records_per_user_input["1200"] == 1
    assert verify_bound(input_path, str(tmp_path / "beam"), k)["ok"]


def test_the_selection_is_written_in_more_files_as_the_input_grows(tmp_path, sharded_input, monkeypatch):
    """Without --output-shards, one selection file per RECORDS_PER_SHARD valid input records, the same
    files on both engines (Beam counts the records in the pipeline): no one worker writes it all."""
    from madp.core import selection

    monkeypatch.setattr(selection, "RECORDS_PER_SHARD", 1000)
    local, beam = assert_same(tmp_path, sharded_input, BoundOptions(max_contributions=2), ["--partitions=4"])
    assert local.input_records == 3000 and len(selection_files(str(tmp_path / "local"))) == 3
    assert [f.name for f in beam.selection_files] == [f"part-0000{i}-of-00003.parquet" for i in range(3)]
    assert verify_bound(sharded_input, str(tmp_path / "beam"), 2)["ok"]
