"""Planning that leads to a job that runs: `madp recommend-k` checks each k against the sampler's and
the accountant's constraints (infeasible rows say why and what to change; the sweep never stops), picks
k by its excess-risk proxy among the feasible ones, writes a `madp run` config that runs as written,
and `madp run` refuses an infeasible plan before it bounds."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

from madp.accounting.truncation import smallest_max_batch_size, truncation_delta
from madp.cli import main
from madp.core import sampling
from madp.jobs.run_check import check_feasible
from madp.jobs.run_config import RunConfig
from madp.jobs.run_plan import stages_of
from madp.tools.data.synthetic import GraphSpec, generate, to_table
from madp.tools.planning.feasibility import largest_min_sep_reaching

USERS = ["--users-columns", "from,to,cc"]


@pytest.fixture(scope="module")
def emails(tmp_path_factory):
    """1,500 synthetic records as an email export: `from`, `to`, `cc`, and logistic-regression content."""
    path = str(tmp_path_factory.mktemp("planning") / "emails.parquet")
    pq.write_table(to_table(generate(GraphSpec(records=1500, features=4, seed=3)), users_as="from-to-cc"), path)
    return path


def sweep(capsys, data: str, *options: str) -> tuple[int, dict, str]:
    code = main(["-q", "recommend-k", data, *USERS, "--epsilon", "4", "--delta", "1e-5", *options])
    out, err = capsys.readouterr()
    return code, json.loads(out) if out.strip() else {}, err


def test_smallest_max_batch_size_against_a_direct_binomial_tail():
    steps, units, probability, epsilon = 7, 60, 0.15, 2.0

    def direct(max_batch: int) -> float:  # T P[Binomial(U, p) > B_max] (1 + e^eps), summed term by term
        tail = sum(
            math.comb(units, j) * probability**j * (1 - probability) ** (units - j)
            for j in range(max_batch + 1, units + 1)
        )
        return min(1.0, steps * tail) * (1 + math.exp(epsilon))

    for max_batch in (1, 9, 15, 30, 59, 60):
        assert truncation_delta(steps, units, probability, max_batch, epsilon) == pytest.approx(direct(max_batch))
    for budget in (1e-2, 1e-6, 1e-12):
        smallest = smallest_max_batch_size(steps, units, probability, epsilon, budget)
        assert direct(smallest) <= budget * (1 + 1e-9) < direct(smallest - 1)
    assert smallest_max_batch_size(steps, units, probability, epsilon, 10.0) == 1  # any B_max: the smallest is 1


@pytest.mark.slow
def test_recommend_k_never_aborts_and_says_what_to_change(emails, capsys):
    # DP-SGD batches of 1000: k = 1 keeps fewer records than that (the README's example aborted there)
    code, result, err = sweep(capsys, emails, "--steps", "20", "--batch-size", "1000", "--k", "1,2,8")
    assert code == 0 and [row["k"] for row in result["sweep"]] == [1, 2, 8]
    first = result["sweep"][0]
    assert not first["feasible"] and first["noise_multiplier"] is None
    assert f"--batch-size 1000 exceeds the {first['kept_records']} records" in first["problems"][0]
    assert f"use --batch-size <= {first['kept_records']}" in first["problems"][0]
    assert result["sweep"][-1]["feasible"] and result["recommended_k"] is not None
    assert "--dataset-size" not in err and "INFEASIBLE" in err and "k = 1: --batch-size 1000" in err

    # BandMF at min-sep 8: exclusion caps the expected batch size; the fix names a batch size and a min-sep
    options = ("--steps", "40", "--batch-size", "30", "--mechanism", "bandmf", "--min-sep", "8", "--bands", "8")
    code, result, err = sweep(capsys, emails, *options, "--k", "1,4,16")
    assert code == 0
    rows = {row["k"]: row for row in result["sweep"]}
    infeasible = [row for row in rows.values() if not row["feasible"]]
    assert infeasible and len(infeasible) < len(rows), "min-sep 8 caps the larger k below 30, not k = 1"
    for row in infeasible:
        (problem,) = row["problems"]
        assert "--batch-size 30 unreachable at --min-sep 8" in problem
        assert f"use --batch-size <= {math.floor(row['largest_batch_size'])}" in problem
        assert "--min-sep <= " in problem and "--bands <= " in problem
        assert row["largest_batch_size"] < 30 and row["sampling_probability"] is None
    for row in rows.values():
        if row["feasible"]:
            assert row["largest_batch_size"] >= 30 and row["sampling_probability"] > 0

    # nothing feasible: every row says why, and no config is written (exit 1)
    config = os.path.join(os.path.dirname(emails), "none.yaml")
    code, result, err = sweep(capsys, emails, *options[:3], "100000", "--k", "1,2", "--write-config", config)
    assert code == 1 and result["recommended_k"] is None and not os.path.exists(config)
    assert all(not row["feasible"] and row["problems"] for row in result["sweep"])


@pytest.mark.slow
def test_the_largest_min_sep_reaching_a_batch_size_is_bisected_as_a_scan_finds_it():
    """The min-sep an unreachable batch size is told to use: the largest b below --min-sep whose
    b-min-sep sampling reaches it, found by bisection (a --min-sep of 10^8 hung scanning down from
    it), the same b a scan finds."""
    sizes, counts = np.array([1, 2, 3, 5]), np.array([500, 300, 100, 50])

    def reach(min_sep):
        return sampling.largest_expected_batch_size(sizes, counts, min_sep).largest

    for target in (reach(2), reach(7) + 0.5, reach(30), 1.0, 950.0, 951.0):
        scanned = next((b for b in range(39, 0, -1) if reach(b) >= target), None)
        assert largest_min_sep_reaching(target, sizes, counts, 40) == scanned
    far = largest_min_sep_reaching(10.0, sizes, counts, 10**8)
    assert far is not None and reach(far) >= 10.0 > reach(far + 1)
    assert largest_min_sep_reaching(10.0, sizes, counts, 1) is None


def test_the_criterion_picks_the_feasible_k_of_least_excess_risk(emails, capsys):
    # few steps: variance is small and bias (records dropped) decides; min-sep 8 makes the larger k,
    # whose risk is smaller still, infeasible
    options = ("--steps", "8", "--batch-size", "30", "--mechanism", "bandmf", "--min-sep", "8", "--bands", "2")
    code, result, _ = sweep(capsys, emails, *options, "--k", "1,2,3,4,8,16")
    assert code == 0
    rows = result["sweep"]
    feasible = [row for row in rows if row["feasible"]]
    chosen = min(feasible, key=lambda row: row["excess_risk"])
    assert result["recommended_k"] == chosen["k"]
    assert any(row["excess_risk"] < chosen["excess_risk"] for row in rows if not row["feasible"])
    for row in rows:
        bias, variance = 1 - row["kept_fraction"], 8 * (row["noise_multiplier"] / 30) ** 2
        assert row["bias"] == pytest.approx(bias, abs=1e-5) and row["variance"] == pytest.approx(variance, rel=1e-4)
        assert row["excess_risk"] == pytest.approx(bias + variance, abs=1e-5)
    assert sum(row["median_heuristic"] for row in rows) == 1 and result["median_heuristic_k"] in (1, 2, 3)
    assert "smallest excess-risk proxy" in result["reason"]


@pytest.mark.tf
def test_the_written_config_runs_as_written(emails, tmp_path, capsys):
    # one k: the trainer's DP-SGD calibration (PLD, fine grid) takes most of this test's ~35 s
    config = str(tmp_path / "job.yaml")
    code, result, _ = sweep(capsys, emails, "--steps", "6", "--batch-size", "40", "--k", "1", "--write-config", config)
    assert code == 0 and result["config"] == config
    job = yaml.safe_load(open(config))
    row = next(row for row in result["sweep"] if row["k"] == result["recommended_k"])
    assert job["input"] == os.path.abspath(emails) and job["run_dir"] == str(tmp_path / "job-output")
    assert job["bound"]["max_contributions"] == row["k"] and job["bound"]["users_columns"] == ["from", "to", "cc"]
    assert job["batch"] == {"steps": 6, "batch_size": 40, "min_sep": 1, "max_batch_size": row["max_batch_size"]} | {
        "runner": "local"
    }
    assert job["calibrate"]["epsilon"] == 4 and job["train"] == {"model": "logreg"}
    assert row["truncation_delta"] <= 0.1 * 1e-5

    assert main(["-q", "run", config]) == 0
    summary = json.loads(capsys.readouterr().out)
    privacy = summary["results"]["privacy"]
    assert privacy["contribution_bound"] == row["k"] and privacy["epsilon"] <= 4 and privacy["delta"] <= 1e-5
    assert privacy["noise_multiplier"] == pytest.approx(row["noise_multiplier"], rel=0.05)  # the sweep's coarse grid
    assert summary["results"]["bound"]["selected_records"] == row["kept_records"]


def job(tmp_path, emails: str, k: int, batch: dict, calibrate: dict, train: dict):
    """A `madp run` config on the email export, bounded and batched locally: (its path, its run_dir)."""
    config, run_dir = tmp_path / "job.yaml", tmp_path / "out"
    bound = {"max_contributions": k, "users_columns": ["from", "to", "cc"], "runner": "local"}
    sections = {"bound": bound, "batch": {**batch, "runner": "local"}, "calibrate": calibrate, "train": train}
    config.write_text(yaml.safe_dump({"run_dir": str(run_dir), "input": emails, **sections}))
    return config, run_dir


def test_run_refuses_an_infeasible_plan_before_bounding(emails, tmp_path, capsys):
    batch = {"steps": 50, "batch_size": 150, "min_sep": 8, "max_batch_size": 200}
    config, run_dir = job(tmp_path, emails, 8, batch, {"epsilon": 8, "delta": 1e-5, "bands": 8}, {"model": "logreg"})
    assert main(["-q", "run", str(config)]) == 2
    err = capsys.readouterr().err
    assert "before bounding" in err and "batch.batch_size 150 unreachable at batch.min_sep 8 with k = 8" in err
    assert "use batch.batch_size <= " in err and "batch.min_sep <= " in err and "calibrate.bands <= " in err
    assert not (run_dir / "bound").exists() and not (run_dir / "batches").exists()

    # DP-SGD at epsilon 8 with a B_max too tight for it: the truncation delta calibration would refuse
    poisson = ["--set", "batch.min_sep=1", "--set", "calibrate.bands=1", "--set", "batch.max_batch_size=160"]
    assert main(["-q", "run", str(config), *poisson]) == 2
    err = capsys.readouterr().err
    assert "batch.max_batch_size 160: truncation costs delta" in err and "at epsilon 8" in err
    assert not (run_dir / "bound").exists()
    fix = int(err.split("use batch.max_batch_size >= ")[1].split()[0])
    sets = ["batch.min_sep=1", "calibrate.bands=1", f"batch.max_batch_size={fix}"]
    check_feasible(stages_of(RunConfig.read(str(config), sets)))  # the proposed B_max passes


@pytest.mark.slow
def test_a_recommendation_at_the_largest_k_swept_says_to_sweep_further(emails, capsys):
    # few steps at a small batch: variance is small, so the proxy still falls at the largest k swept
    code, result, _ = sweep(capsys, emails, "--steps", "4", "--batch-size", "30", "--k", "1,2")
    assert code == 0 and result["recommended_k"] == 2
    assert "largest k swept and the proxy was still falling there" in result["reason"]
    assert "(--k 1,2,4,8)" in result["reason"]


def _text_emails(path) -> str:
    """Text records whose label column is `category`: the recommend-k plan must not assume `label`."""
    rows = [
        {"id": i, "users": [f"u{i % 40}", f"u{(i * 7) % 40}"], "text": f"message {i}", "category": "ab"[i % 2]}
        for i in range(200)
    ]
    with open(path, "w") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in rows)
    return str(path)


@pytest.mark.slow
def test_recommend_k_plans_a_classifier_on_the_label_column_named(tmp_path, capsys):
    data, config = _text_emails(tmp_path / "text.jsonl"), str(tmp_path / "job.yaml")
    args = ["-q", "recommend-k", data, "--epsilon", "4", "--delta", "1e-5", "--steps", "4", "--batch-size", "10"]
    # --labels on data without a `label` column: refused by name, not a byte-level LM planned silently
    assert main([*args, "--k", "1", "--labels", "a,b", "--write-config", config]) == 2
    err = capsys.readouterr().err
    assert "--labels: the input has no label column 'label'" in err and "--label-column" in err
    assert not os.path.exists(config)
    assert main([*args, "--k", "1", "--labels", "a,b", "--label-column", "category", "--write-config", config]) == 0
    capsys.readouterr()
    train = yaml.safe_load(open(config))["train"]
    assert train == {"model": "text-classifier", "text_column": "text", "label": "category", "labels": ["a", "b"]}
    assert main([*args, "--k", "1", "--text-column", "body", "--write-config", config]) == 2
    assert "--text-column body: the input has no such column" in capsys.readouterr().err


def test_run_refuses_a_column_the_training_reads_but_the_records_lack_before_bounding(emails, tmp_path, capsys):
    batch, calibrate = {"steps": 4, "batch_size": 20}, {"epsilon": 8, "delta": 1e-5}
    config, run_dir = job(tmp_path, emails, 2, batch, calibrate, {"model": "logreg", "label": "y"})
    assert main(["-q", "run", str(config)]) == 2
    err = capsys.readouterr().err
    assert "the train section's model logreg reads the column(s) y, which the records" in err
    assert not (run_dir / "bound").exists()
    held_out = str(tmp_path / "held-out.jsonl")  # features, but the labels under another name
    with open(held_out, "w") as handle:
        handle.writelines(json.dumps({"features": [0.0] * 4, "y": 1}) + "\n" for _ in range(5))
    for sets, expected in (
        (["train.model=text-lm", "train.text_column=body"], "reads the column(s) body"),
        (["train.eval_data=" + held_out], f"which the evaluation data {held_out} lack"),
        (["batch.content_columns=features"], "which the batch section's content_columns (features) leave out"),
    ):
        overrides = [arg for key in sets for arg in ("--set", key)]
        label = [] if "train.model=text-lm" in sets else ["--set", "train.label=label"]
        assert main(["-q", "run", str(config), *label, *overrides]) == 2
        assert expected in capsys.readouterr().err
        assert not (run_dir / "bound").exists()
