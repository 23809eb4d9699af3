"""`madp recommend-k`: monotone sweep, the ELS median heuristic, one read of the input, and the
kept counts of the real bounding."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import write_records

from madp.cli import main
from madp.core import record_reading
from madp.core.errors import InputError
from madp.core.selection import BoundOptions
from madp.engines.local_engine import run_local
from madp.tools.data.synthetic import GraphSpec, generate, to_table
from madp.tools.planning.recommend import SWEEP_FILE, Recommendation, Sweep, recommend, write_sweep

pytestmark = [pytest.mark.slow]


@pytest.fixture(scope="module")
def skewed(tmp_path_factory):
    directory = tmp_path_factory.mktemp("recommend")
    return write_records(
        str(directory / "records.jsonl"), to_table(generate(GraphSpec(records=3000, features=2, seed=7))).to_pylist()
    )


def test_larger_k_keeps_more_and_costs_more_noise(skewed):
    result = recommend(skewed, Sweep(epsilon=4, delta=1e-5, steps=200, batch_size=50, ks=(1, 2, 3, 5, 8)))
    rows = result.sweep
    assert [row.k for row in rows] == [1, 2, 3, 5, 8]
    for smaller, larger in zip(rows, rows[1:]):
        assert larger.kept_records >= smaller.kept_records
        assert larger.kept_records_with_duplicates >= smaller.kept_records_with_duplicates
        assert larger.users_capped_fraction <= smaller.users_capped_fraction
        assert larger.noise_multiplier > smaller.noise_multiplier
    assert all(row.kept_records_with_duplicates >= row.kept_records for row in rows)
    assert all(row.epsilon <= 4 for row in rows)
    # bounding keeps few-user records first: kept records have fewer users than the input's mean
    assert rows[0].mean_users_per_kept_record < result.input.mean_users_per_record
    noise = rows[2].noise_multiplier * 1.0 / 50
    assert rows[2].noise_std_over_batch == pytest.approx(noise)


def test_kept_counts_are_those_of_madp_bound(skewed, tmp_path):
    result = recommend(skewed, Sweep(epsilon=4, delta=1e-5, steps=50, batch_size=50, ks=(3,)))
    bounded = run_local(skewed, str(tmp_path / "b3"), BoundOptions(max_contributions=3))
    assert result.sweep[0].kept_records == bounded.selected_records
    duplicates = run_local(skewed, str(tmp_path / "d3"), BoundOptions(max_contributions=3, duplicates=True))
    assert result.sweep[0].kept_records_with_duplicates == duplicates.selected_records


def test_els_median_heuristic_and_recommendation(tmp_path):
    # users 0..9 own 1, 1, 2, 3, 3, 3, 4, 5, 5, 6 single-user records: median 3
    counts = [1, 1, 2, 3, 3, 3, 4, 5, 5, 6]
    rows, next_id = [], 0
    for user, count in enumerate(counts):
        for _ in range(count):
            rows.append({"id": next_id, "users": [user]})
            next_id += 1
    data = write_records(str(tmp_path / "single.jsonl"), rows)
    result = recommend(data, Sweep(epsilon=4, delta=1e-3, steps=20, batch_size=5, ks=(1, 2, 4, 8)))
    assert result.input.median_records_per_user == float(np.median(counts)) == 3.0
    assert result.median_heuristic_k == 2  # the swept k nearest the median (2 and 4 tie: the smaller)
    assert [row.median_heuristic for row in result.sweep] == [False, True, False, False]
    assert "median user has 3 records" in result.reason
    scored = [row for row in result.sweep if row.feasible]
    assert result.recommended_k == min(scored, key=lambda row: row.excess_risk).k
    kept = {row.k: row.kept_records for row in result.sweep}
    assert kept == {k: sum(min(c, k) for c in counts) for k in (1, 2, 4, 8)}


def test_the_sweep_reads_back_as_written(skewed, tmp_path):
    """recommend-k.json (`write_sweep`) holds the sweep's to_json() after its format_version, and reads
    back as the same sweep; a file of a newer format is refused, naming it."""
    result = recommend(skewed, Sweep(epsilon=4, delta=1e-5, steps=50, batch_size=1500, ks=(1, 8)))  # k = 1: too few
    assert any(row.feasible for row in result.sweep) and any(row.excess_risk is None for row in result.sweep)
    write_sweep(str(tmp_path), result)
    path = tmp_path / SWEEP_FILE
    written = json.loads(path.read_text())
    assert list(written)[0] == "format_version" and written["format_version"] == 1
    assert written == result.to_json() and Recommendation.from_json(written, str(path)) == result
    del written["format_version"]  # a sweep of madp before the key: the same keys
    assert Recommendation.from_json(written, str(path)) == result
    with pytest.raises(InputError, match=f"{path}: format_version 2 is not one"):
        Recommendation.from_json({**written, "format_version": 2}, str(path))
    with pytest.raises(InputError, match=f"{path} is not a madp recommend-k sweep"):
        Recommendation.from_json({**written, "sweep": [{"k": 1}]}, str(path))


def test_the_input_is_read_once(skewed, monkeypatch):
    reads = []
    original = record_reading.read_file
    monkeypatch.setattr(
        record_reading, "read_file", lambda *args, **kwargs: reads.append(args[0]) or original(*args, **kwargs)
    )
    recommend(skewed, Sweep(epsilon=4, delta=1e-5, steps=50, batch_size=50, ks=(1, 2, 4)))
    assert reads == [skewed]


def test_cli(skewed, capsys):
    assert (
        main(
            [
                "-q",
                "recommend-k",
                skewed,
                "--epsilon",
                "4",
                "--delta",
                "1e-5",
                "--steps",
                "50",
                "--batch-size",
                "50",
                "--k",
                "1,4",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert [row["k"] for row in out["sweep"]] == [1, 4] and out["recommended_k"] in (1, 4)
    assert (
        main(
            [
                "-q",
                "recommend-k",
                skewed,
                "--epsilon",
                "4",
                "--delta",
                "1e-5",
                "--steps",
                "50",
                "--batch-size",
                "50",
                "--k",
                "1,x",
            ]
        )
        == 2
    )
    assert "--k must list integers" in capsys.readouterr().err
    assert (
        main(
            [
                "-q",
                "recommend-k",
                skewed,
                "--epsilon",
                "4",
                "--delta",
                "1e-5",
                "--steps",
                "50",
                "--batch-size",
                "50",
                "--min-sep",
                "4",
            ]
        )
        == 2
    )
    assert "--mechanism dpsgd is plain Poisson sampling" in capsys.readouterr().err
