"""`madp batch --on-invalid skip` keeps selected records with invalid content (a NaN, a null) in the
sampling population: p, the units and the schedule (which units each step samples, and which of them
min-sep exclusion drops) are functions of the graph only, and only those records' rows are left out
of the batches. Otherwise a record's content would move the published p and its co-owners' batches."""

from __future__ import annotations

import collections
import json
import os

import pyarrow as pa
import pytest
from conftest import write_records

from madp.cli import main
from madp.core.hashing import partition_of
from madp.core.verify import _example_class, _feature_values, read_tfrecord

ENGINES = {
    "local": ["--runner", "local"],
    "beam": ["--runner", "DirectRunner", "--direct_running_mode", "in_memory", "--partitions", "3"],
}
# (engine, sampler, the records' users, sampler options): minsep on both engines; the greedy and
# the user-level sampler run in the driver whatever the runner.
CASES = [
    pytest.param("local", "minsep", "two", ["--batch-size", "3", "--min-sep", "2"], id="local-minsep"),
    pytest.param(
        "beam", "minsep", "two", ["--batch-size", "3", "--min-sep", "2"], id="beam-minsep", marks=pytest.mark.beam
    ),
    pytest.param("local", "minsep-greedy", "two", ["--batch-size", "6", "--min-sep", "3"], id="local-greedy"),
    pytest.param("local", "users", "one", ["--batch-size", "4"], id="local-users"),
]


def records(users: str) -> list[dict]:
    """200 records; "two": each of two users (so exclusion links records), "one": single attribution."""
    owners = (lambda i: [i % 31, 100 + i % 29]) if users == "two" else (lambda i: [i % 23])
    return [{"id": i, "users": owners(i), "x": [float(i), 1.0], "label": i % 2} for i in range(200)]


def cli(capsys, *args) -> tuple[int, dict | None, str]:
    code = main(["-q", *map(str, args)])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.strip().startswith("{") else None), err


def batch_rows(output) -> list[dict]:
    example = _example_class()
    names = sorted(n for n in os.listdir(output) if n.endswith(".tfrecord"))
    parsed = [example.FromString(p) for name in names for p in read_tfrecord(os.path.join(output, name))]
    return [{k: tuple(_feature_values(e, k)) for k in e.features.feature} for e in parsed]


def real_rows(rows: list[dict]) -> collections.Counter:
    """Real rows (weight 1) as a multiset of their features, step and id included (copies repeat)."""
    return collections.Counter(tuple(sorted(r.items())) for r in rows if r["weight"] == (1.0,))


@pytest.mark.parametrize(("engine", "sampler", "users", "sampler_options"), CASES)
def test_invalid_content_changes_neither_p_nor_the_schedule(tmp_path, capsys, engine, sampler, users, sampler_options):
    clean = records(users)
    clean_data = write_records(str(tmp_path / "clean.jsonl"), clean)
    assert cli(capsys, "bound", clean_data, tmp_path / "bound", "-k", "3", *ENGINES[engine])[0] == 0
    common = ["--steps", "12", "--sampler", sampler, *sampler_options, "--seed", "0", "--on-invalid", "skip"]
    code, clean_report, err = cli(
        capsys, "batch", tmp_path / "bound", clean_data, tmp_path / "clean", *common, *ENGINES[engine]
    )
    assert code == 0, err
    clean_rows = batch_rows(tmp_path / "clean")
    # Two records the clean run samples early, so that they block their users' next steps.
    sampled = list(dict.fromkeys(r["id"][0] for r in clean_rows if r["weight"] == (1.0,)))
    nan_id, null_id = sampled[:2]
    dirty = [
        {**r, "x": [float("nan"), 1.0]} if r["id"] == nan_id else {**r, "label": None} if r["id"] == null_id else r
        for r in clean
    ]
    dirty_data = write_records(str(tmp_path / "dirty.jsonl"), dirty)

    code, dirty_report, err = cli(
        capsys, "batch", tmp_path / "bound", dirty_data, tmp_path / "dirty", *common, *ENGINES[engine]
    )

    assert code == 0, err
    assert dirty_report["rejected"] == {"non_finite_content": 1, "null_content": 1}
    rejected = [json.loads(line) for line in open(tmp_path / "dirty" / "rejected" / "rejected.jsonl")]
    assert sorted(r["record"]["id"] for r in rejected) == sorted([nan_id, null_id])
    for key in ("sampling_probability", "units", "records", "batch_sizes"):
        assert dirty_report[key] == clean_report[key], key
    dirty_rows = batch_rows(tmp_path / "dirty")
    assert not {nan_id, null_id} & {r["id"][0] for r in dirty_rows}
    valid_clean_rows = [r for r in clean_rows if r["id"][0] not in (nan_id, null_id)]
    assert real_rows(dirty_rows) == real_rows(valid_clean_rows)  # same rows at the same steps
    assert dirty_report["records_never_written"] == clean_report["records_never_written"] + 2


@pytest.mark.beam
def test_engines_agree_when_a_partition_writes_no_row(tmp_path, capsys):
    """Every selected record of one Beam partition has invalid content: that partition writes no
    row, so its (empty) description must not turn the fixed-length feature `x` variable-length, and
    both engines write the same bytes."""
    clean = records("two")
    bad = set(
        (partition_of(pa.array([r["id"] for r in clean], pa.int64()), 3) == 0).nonzero()[0].tolist()
    )  # ids are 0..199, so positions are ids
    dirty = [{**r, "x": [float("inf"), 1.0]} if r["id"] in bad else r for r in clean]
    clean_data = write_records(str(tmp_path / "clean.jsonl"), clean)
    dirty_data = write_records(str(tmp_path / "dirty.jsonl"), dirty)
    assert cli(capsys, "bound", clean_data, tmp_path / "bound", "-k", "3", "--runner", "local")[0] == 0
    common = ["--steps", "12", "--batch-size", "3", "--min-sep", "2", "--seed", "0", "--on-invalid", "skip"]
    outputs = {}
    for engine in ENGINES:
        code, report, err = cli(
            capsys, "batch", tmp_path / "bound", dirty_data, tmp_path / engine, *common, *ENGINES[engine]
        )
        assert code == 0, err
        assert report["rejected"]["non_finite_content"] > 0
        outputs[engine] = {
            name: (tmp_path / engine / name).read_bytes()
            for name in sorted(os.listdir(tmp_path / engine))
            if name.endswith(".tfrecord") or name == "schema.json"
        }
    assert json.loads(outputs["beam"]["schema.json"])["features"]["x"]["shape"] == [2]
    assert outputs["beam"] == outputs["local"]
