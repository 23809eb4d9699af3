"""`madp report`: the HTML page of a run, its numbers from the run's reports, and (when Chromium is
installed) that it renders."""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess

import pytest
import yaml

from madp.cli import main
from madp.tools.report import GRAPH_STATEMENT

pytestmark = [pytest.mark.slow]  # every test reads the job its fixture runs

pytest.importorskip("matplotlib")
pytest.importorskip("tensorflow")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("report")
    config = {
        "run_dir": str(directory / "run"),
        "generate": {"records": 3000, "features": 4, "seed": 2, "holdout": True},
        "bound": {"max_contributions": 2, "runner": "local"},
        "batch": {"steps": 40, "batch_size": 50, "min_sep": 3, "runner": "local"},
        "calibrate": {"epsilon": 4, "delta": 1e-5, "bands": 3},
        "train": {"model": "logreg", "eval_every": 10, "baseline": True, "eval_data_public": True},  # synthetic
        "report": True,
    }
    (directory / "job.yaml").write_text(yaml.safe_dump(config))
    assert main(["-q", "run", str(directory / "job.yaml")]) == 0
    return str(directory / "run")


def test_report_numbers_come_from_the_runs_reports(run_dir, capsys):
    page = open(os.path.join(run_dir, "report.html")).read()
    bound = json.load(open(os.path.join(run_dir, "bound", "report.json")))
    plan = json.load(open(os.path.join(run_dir, "calibration.json")))
    final = json.load(open(os.path.join(run_dir, "train", "metrics.json")))["final"]
    cells = dict(re.findall(r"<tr><td>(.*?)</td><td>(.*?)</td></tr>", page))
    assert cells["selected records"] == f"{bound['selected_records']:,}"
    assert cells["noise multiplier sigma"] == f"{plan['noise_multiplier']:.4g}"
    assert cells["private eval accuracy"] == f"{final['accuracy']:.4f}"
    # Where the guarantee is stated, what it rests on; and which figures describe the (unprotected) graph
    privacy = json.load(open(os.path.join(run_dir, "train", "privacy.json")))
    assert privacy["assumptions"] and all(html.escape(a) in page for a in privacy["assumptions"])
    assert "What the guarantee rests on" in page and html.escape(GRAPH_STATEMENT) in page
    assert page.count("<img ") == 6 and "data:image/png;base64," in page
    assert "Not in this run" not in page
    assert len(plan["epsilon_curve"]) == 9 and sorted(e for _, e in plan["epsilon_curve"])[::-1] == [
        e for _, e in plan["epsilon_curve"]
    ]  # epsilon falls as sigma grows
    histograms = bound["histograms"]
    assert sum(histograms["records_per_user_input"].values()) == bound["input_users"]
    assert sum(histograms["records_by_users_selected"].values()) == bound["distinct_selected"]
    assert max(int(v) for v in histograms["records_per_user_selected"]) <= 2


def test_a_partial_run_lists_what_is_missing(run_dir, tmp_path, capsys):
    partial = tmp_path / "partial"
    shutil.copytree(os.path.join(run_dir, "bound"), partial / "bound")
    assert main(["-q", "report", str(partial)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["figures"] == ["Records per user", "Kept fraction by record arity"]
    assert "calibration.json" in result["missing"] and "Not in this run" in open(partial / "report.html").read()
    assert main(["-q", "report", str(tmp_path / "nothing")]) == 2
    assert "no reports of a `madp run`" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("chromium") is None, reason="Chromium (Debian package chromium) is not installed")
def test_the_page_renders_in_headless_chromium(run_dir, tmp_path):
    from matplotlib import image

    screenshot = tmp_path / "report.png"
    subprocess.run(
        [
            "chromium",
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--window-size=1200,3400",
            f"--screenshot={screenshot}",
            "file://" + os.path.abspath(os.path.join(run_dir, "report.html")),
        ],
        capture_output=True,
        timeout=120,
        check=True,
    )
    pixels = image.imread(str(screenshot))
    ink = (pixels[..., :3].mean(axis=2) < 0.9).mean()
    assert pixels.shape[:2] == (3400, 1200) and ink > 0.03  # drawn plots, not a blank or error page


def test_a_run_planned_by_recommend_k_shows_the_curve_that_chose_k(run_dir, tmp_path, capsys):
    planned = tmp_path / "planned"
    shutil.copytree(os.path.join(run_dir, "bound"), planned / "bound")
    data = os.path.join(run_dir, "records")
    config = str(tmp_path / "job.yaml")
    argv = ["-q", "recommend-k", data, "--epsilon", "4", "--delta", "1e-5", "--steps", "20", "--batch-size", "40"]
    assert main([*argv, "--k", "1,2,4", "--write-config", config, "--run-dir", str(planned)]) == 0
    chosen = json.loads(capsys.readouterr().out)["recommended_k"]
    assert json.load(open(planned / "recommend-k.json"))["recommended_k"] == chosen
    assert main(["-q", "report", str(planned)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["figures"][0] == "Choosing k" and "recommend-k.json" not in result["missing"]
    assert f"k = {chosen} has the smallest excess-risk proxy" in open(planned / "report.html").read()


def test_a_pretrained_language_model_run_shows_its_starting_loss(tmp_path, capsys):
    train = tmp_path / "lm" / "train"
    train.mkdir(parents=True)
    points = [{"step": s, "loss": 3.0 - s / 100, "perplexity": 2.7 ** (3.0 - s / 100), "tokens": 900} for s in (10, 20)]
    metrics = {"model": "causal-lm", "eval_data_public": True, "eval": points, "final": points[-1], "lora_rank": 8,
               "pretrained_eval": {"loss": 3.25, "perplexity": 25.8, "tokens": 900}}  # fmt: skip
    (train / "metrics.json").write_text(json.dumps(metrics))
    assert main(["-q", "report", str(tmp_path / "lm")]) == 0
    assert json.loads(capsys.readouterr().out)["figures"] == ["Training"]
    cells = dict(re.findall(r"<tr><td>(.*?)</td><td>(.*?)</td></tr>", open(tmp_path / "lm" / "report.html").read()))
    assert cells["pretrained model eval loss, before training"] == "3.2500"
    assert cells["private eval perplexity"] == f"{points[-1]['perplexity']:.4f}"


def test_evaluations_of_a_metrics_file_that_does_not_say_its_eval_data_was_public_stay_internal(tmp_path, capsys):
    """madp before 2026-11-27 wrote every evaluation into metrics.json: without `eval_data_public` a
    published page leaves them out (they may be on the trained records); an internal page shows them."""
    train = tmp_path / "old" / "train"
    train.mkdir(parents=True)
    point = {"step": 10, "loss": 0.5, "accuracy": 0.8125}
    (train / "metrics.json").write_text(json.dumps({"model": "logreg", "eval": [point], "final": point}))
    assert main(["-q", "report", str(tmp_path / "old")]) == 0
    capsys.readouterr()
    assert "0.8125" not in open(tmp_path / "old" / "report.html").read()
    assert main(["-q", "report", "--internal", str(tmp_path / "old"), "--output", str(tmp_path / "inside.html")]) == 0
    assert "0.8125" in open(tmp_path / "inside.html").read()
