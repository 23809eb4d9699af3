"""Ordinary actions that must not break a printed guarantee (issue: every guarantee holds under what users
plausibly do): an input edited behind `madp run`'s back, a runner option that overrides a checked key, a
second writer inside a running job, an output that overlaps its input, a failed re-run, a fixed sigma
whose truncation eats delta, a Monte Carlo calibration retried under another request, realized sampling
in logs, and a second training on the same secret batches. All through the command line."""

from __future__ import annotations

import json
import os
import re
import socket

import pytest
import yaml
from conftest import snapshot, write_records

from madp.cli import main
from madp.core.storage import LOCK_FILE


def rows(count: int) -> list[dict]:
    """Records of a user of their own and one shared by two records: the bound with K = 2 keeps them all."""
    return [
        {"id": i, "users": [i, 1000 + i // 2], "features": [float(i % 3), 1.0], "label": i % 2} for i in range(count)
    ]


def run_job(tmp_path, capsys, extra: dict | None = None, records: int = 400) -> tuple[int, dict | None, str]:
    data = tmp_path / "records.jsonl"
    if not data.exists():
        write_records(str(data), rows(records))
    config = {
        "run_dir": str(tmp_path / "run"),
        "input": str(data),
        "bound": {"max_contributions": 2, "runner": "local"},
        **(extra or {}),
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(config))
    code = main(["-q", "run", str(tmp_path / "job.yaml")])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.strip().startswith("{") else None), err


def statuses(summary: dict) -> dict[str, str]:
    return {s["stage"]: s["status"] for s in summary["stages"]}


def test_an_edit_that_keeps_size_and_time_reruns_the_bound(tmp_path, capsys):
    code, summary, _ = run_job(tmp_path, capsys)
    assert code == 0 and statuses(summary)["bound"] == "ran"
    data = tmp_path / "records.jsonl"
    before = os.stat(data)
    text = data.read_text()
    edited = text.replace('"users": [1, 1000]', '"users": [3, 1000]', 1)  # same size: one digit for another
    assert edited != text and len(edited) == len(text)
    data.write_text(edited)
    os.utime(data, ns=(before.st_atime_ns, before.st_mtime_ns))  # as `cp -p` or `rsync -t` leave it
    code, summary, _ = run_job(tmp_path, capsys)
    assert code == 0 and statuses(summary)["bound"] == "ran", "the claim must be made for the graph now on disk"


def test_records_appended_during_a_stage_are_not_recorded_as_done(tmp_path, capsys, monkeypatch):
    from madp.jobs.run_steps import Bound

    real_run = Bound.run

    def run_then_append(self):
        result = real_run(self)
        with open(tmp_path / "records.jsonl", "a") as handle:
            handle.write(json.dumps({"id": 10_000, "users": [1], "features": [0.0, 1.0], "label": 0}) + "\n")
        return result

    monkeypatch.setattr(Bound, "run", run_then_append)
    code, _, err = run_job(tmp_path, capsys)
    assert code == 2 and "changed while it ran" in err
    assert not (tmp_path / "run" / ".madp" / "bound.json").exists(), "the stage must run again"


def test_a_runner_option_cannot_override_a_checked_key(tmp_path, capsys):
    bound = {"max_contributions": 2, "runner": "DirectRunner", "runner_options": ["--max-contributions", "50"]}
    code, _, err = run_job(tmp_path, capsys, {"bound": bound})
    assert code == 2 and "bound.runner_options: --max-contributions is an option of madp bound" in err
    bound["runner_options"] = ["--max-contrib=50"]  # argparse would take the abbreviation too
    code, _, err = run_job(tmp_path, capsys, {"bound": bound})
    assert code == 2 and "--max-contrib is an option of madp bound" in err
    assert not (tmp_path / "run" / "bound").exists()


def test_a_standalone_command_inside_a_running_job_is_refused(tmp_path, capsys):
    data = write_records(str(tmp_path / "records.jsonl"), rows(100))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    holder = {"pid": os.getppid(), "host": socket.gethostname(), "command": "run job.yaml", "since": "now"}
    (run_dir / LOCK_FILE).write_text(json.dumps(holder))  # a live `madp run` (another process) holds run_dir
    code = main(["-q", "bound", data, str(run_dir / "bound"), "-k", "2", "--runner", "local"])
    assert code == 2 and "being written by another madp process" in capsys.readouterr().err
    assert not (run_dir / "bound" / "report.json").exists()


@pytest.mark.parametrize("layout", ["same", "output contains input", "output inside input"])
def test_an_output_overlapping_its_input_is_refused(tmp_path, capsys, layout):
    folder = tmp_path / "data"
    folder.mkdir()
    data = write_records(str(folder / "records.jsonl"), rows(100))
    source, output = {
        "same": (str(folder), str(folder)),
        "output contains input": (data, str(folder)),
        "output inside input": (str(folder), str(folder / "bound")),
    }[layout]
    code = main(["-q", "bound", source, output, "-k", "2", "--runner", "local"])
    assert code == 2 and "overlaps input" in capsys.readouterr().err
    assert os.listdir(folder) == ["records.jsonl"] and len(open(data).readlines()) == 100


def test_a_failed_rerun_leaves_no_selection(tmp_path, capsys):
    data = write_records(str(tmp_path / "records.jsonl"), rows(100))
    output = tmp_path / "bound"
    assert main(["-q", "bound", data, str(output), "-k", "2", "--runner", "local"]) == 0
    with open(data, "a") as handle:
        handle.write('{"id": 5000, "users": []}\n')  # invalid: the re-run stops
    assert main(["-q", "bound", data, str(output), "-k", "2", "--runner", "local"]) == 2
    capsys.readouterr()
    assert not (output / "report.json").exists() and not os.listdir(output / "selected"), (
        "batch must not find the selection of the earlier input"
    )


@pytest.mark.parametrize("runner", ["local", pytest.param("DirectRunner", marks=pytest.mark.beam)])
def test_a_bound_refused_by_its_checks_leaves_the_earlier_selection(tmp_path, capsys, runner):
    """Capacities whose user ids are strings against integer users, a users column the input lacks: checked
    before the earlier selection and report are replaced, so they stay as they were."""
    data = write_records(str(tmp_path / "records.jsonl"), rows(100))
    output = tmp_path / "bound"
    command = ["-q", "bound", data, str(output), "-k", "2", "--runner", runner]
    assert main(command) == 0
    capsys.readouterr()
    finished = snapshot(output)
    assert "report.json" in finished
    capacities = tmp_path / "capacities.jsonl"
    capacities.write_text('{"user": "5", "capacity": 3}\n')
    for change, message in (
        (["--capacities", str(capacities)], "capacities file has string user ids but the input's user ids are int64"),
        (["--users-column", "nosuch"], "no column ['nosuch'] in any row"),
    ):
        assert main([*command, *change]) == 2
        assert message in capsys.readouterr().err
        assert snapshot(output) == finished and not (output / "_work").exists()


@pytest.mark.tf
def test_a_rerun_never_removes_the_trainings_ledger(tmp_path, capsys):
    """The selection's trainings ledger outlives every re-run of the bound stage: one refused by its checks
    (the selection stays too), and one that meets an invalid row (which leaves no selection)."""
    pytest.importorskip("tensorflow")
    extra = {  # the greedy sampler: madp run's check of the plan on the graph (which reads capacities) is not run
        "batch": {"steps": 10, "batch_size": 40, "min_sep": 2, "sampler": "minsep-greedy", "runner": "local"},
        "calibrate": {"epsilon": 4, "delta": 1e-5, "bands": 2},
        "train": {"model": "logreg", "eval_every": 10},
    }
    code, _, _ = run_job(tmp_path, capsys, extra)
    bound = tmp_path / "run" / "bound"
    assert code == 0 and (bound / "trainings.jsonl").exists()
    finished = snapshot(bound)
    capacities = tmp_path / "capacities.jsonl"
    capacities.write_text('{"user": "5", "capacity": 3}\n')
    extra["bound"] = {"max_contributions": 2, "runner": "local", "capacities": str(capacities)}
    code, _, err = run_job(tmp_path, capsys, extra)
    assert code == 2 and "capacities file has string user ids" in err
    assert snapshot(bound) == finished
    with open(tmp_path / "records.jsonl", "a") as handle:
        handle.write('{"id": 5000, "users": []}\n')  # invalid: the re-run stops
    code, _, err = run_job(tmp_path, capsys)
    assert code == 2 and "invalid input rows" in err
    assert not (bound / "report.json").exists() and not os.listdir(bound / "selected")
    assert (bound / "trainings.jsonl").read_bytes() == finished["trainings.jsonl"]


@pytest.mark.parametrize("runner", ["local", pytest.param("DirectRunner", marks=pytest.mark.beam)])
def test_a_finished_output_holds_no_staging_folder_and_no_emptied_rejects(tmp_path, capsys, runner):
    """A Beam bound or batch left its staging folder `_work/` in OUTPUT, emptied, and a re-run that skips no
    row left the `rejected/` folder of the run before it, emptied: a finished output holds what it documents."""
    records = rows(200)
    data = write_records(str(tmp_path / "records.jsonl"), records)
    invalid_row = write_records(str(tmp_path / "invalid-row.jsonl"), [*records, {"id": 999, "users": []}])
    invalid_content = write_records(
        str(tmp_path / "invalid-content.jsonl"), [{**records[0], "features": None}, *records[1:]]
    )
    bound, batches = tmp_path / "bound", tmp_path / "batches"
    engine = ["--runner", runner]
    assert main(["-q", "bound", invalid_row, str(bound), "-k", "2", "--on-invalid", "skip", *engine]) == 0
    assert sorted(os.listdir(bound)) == ["rejected", "report.json", "selected"]
    assert main(["-q", "bound", data, str(bound), "-k", "2", *engine]) == 0
    assert sorted(os.listdir(bound)) == ["report.json", "selected"]
    batch = ["-q", "batch", str(bound), "DATA", str(batches), "--steps", "10", "--batch-size", "40", *engine]
    assert main([*batch[:3], invalid_content, *batch[4:], "--on-invalid", "skip"]) == 0
    assert sorted(os.listdir(batches)) == ["batches-00000-of-00001.tfrecord", "rejected", "report.json", "schema.json"]
    assert main([*batch[:3], data, *batch[4:]]) == 0
    assert sorted(os.listdir(batches)) == ["batches-00000-of-00001.tfrecord", "report.json", "schema.json"]
    capsys.readouterr()


@pytest.mark.parametrize("runner", ["local", pytest.param("DirectRunner", marks=pytest.mark.beam)])
def test_a_batching_that_fails_its_checks_leaves_the_earlier_batches(tmp_path, capsys, runner):
    """Batches are made with a secret key that is gone once written: a re-run refused by a check (a content
    column DATA lacks, which the pipeline finds on Beam) leaves them, their report and schema as they were."""
    data = write_records(str(tmp_path / "records.jsonl"), rows(400))
    bound, batches = str(tmp_path / "bound"), tmp_path / "batches"
    assert main(["-q", "bound", data, bound, "-k", "2", "--runner", "local"]) == 0
    command = ["-q", "batch", bound, data, str(batches), "--steps", "10", "--batch-size", "40", "--runner", runner]
    assert main(command) == 0
    capsys.readouterr()
    finished = snapshot(batches)
    assert "report.json" in finished and any(name.endswith(".tfrecord") for name in finished)
    assert main([*command, "--content-columns", "features,label,nosuch"]) == 2
    assert "'nosuch'" in capsys.readouterr().err
    assert snapshot(batches) == finished and not (batches / "_work").exists()


@pytest.mark.slow
def test_a_fixed_sigma_whose_truncation_eats_delta_is_refused(tmp_path, capsys):
    extra = {
        "batch": {"steps": 50, "batch_size": 40, "max_batch_size": 41, "runner": "local"},
        "calibrate": {"noise_multiplier": 1.0, "delta": 1e-5},
    }
    code, _, err = run_job(tmp_path, capsys, extra)
    assert code == 2 and "truncation at --max-batch-size adds delta" in err
    assert not (tmp_path / "run" / "calibration.json").exists()


@pytest.mark.slow
def test_the_weight_order_is_an_assumption_of_the_plan(tmp_path, capsys):
    data = tmp_path / "records.jsonl"
    write_records(str(data), [{**row, "w": float(row["id"] % 5)} for row in rows(400)])
    extra = {
        "bound": {"max_contributions": 2, "runner": "local", "order": "weight", "weight_column": "w"},
        "batch": {"steps": 20, "batch_size": 40, "runner": "local"},
        "calibrate": {"noise_multiplier": 1.0, "delta": 1e-5},
    }
    code, _, _ = run_job(tmp_path, capsys, extra)
    assert code == 0
    plan = json.load(open(tmp_path / "run" / "calibration.json"))
    assert any("'w'" in a and "treated as public" in a for a in plan["assumptions"])


def test_batch_logs_hold_no_realized_sampling(tmp_path, capsys, caplog):
    data = write_records(str(tmp_path / "records.jsonl"), rows(400))
    assert main(["-q", "bound", data, str(tmp_path / "bound"), "-k", "2", "--runner", "local"]) == 0
    with caplog.at_level("DEBUG", logger="madp"):
        command = ["batch", str(tmp_path / "bound"), data, str(tmp_path / "batches"), "--steps", "20"]
        assert main([*command, "--batch-size", "40", "--runner", "local"]) == 0
    capsys.readouterr()
    batch = [r for r in caplog.records if r.name == "madp.batch"]
    lines = {level: [r.getMessage() for r in batch if r.levelname == level] for level in ("INFO", "DEBUG")}
    assert not any("rows" in line for line in lines["INFO"]), "how many rows were sampled stays internal"
    assert not any("sampled" in line for line in lines["INFO"]), "so does how long sampling took"
    assert any(re.fullmatch(r"sampled \d+ rows in [\d.]+ s .*", line) for line in lines["DEBUG"])


@pytest.mark.slow
def test_a_monte_carlo_retry_under_another_request_counts_as_an_attempt(capsys):
    base = ["-q", "epsilon", "--mechanism", "bandmf-minsep", "--steps", "12", "--min-sep", "2", "--bands", "2"]
    attempts = []
    for request in (["--delta", "0.05", "--samples", "20000"], ["--delta", "0.0500001", "--samples", "30000"]):
        assert main([*base, "--sampling-prob", "0.2", "--noise-multiplier", "1.0", *request]) == 0
        attempts.append(json.loads(capsys.readouterr().out)["attempts"])
    assert attempts == [1, 2], "the same mechanism verified again is a second attempt, whatever was asked"


@pytest.mark.tf
def test_a_second_training_on_the_same_secret_batches_is_refused_or_composed(tmp_path, capsys):
    pytest.importorskip("tensorflow")
    data = write_records(str(tmp_path / "records.jsonl"), rows(400))
    assert main(["-q", "bound", data, str(tmp_path / "bound"), "-k", "2", "--runner", "local"]) == 0
    batch = ["-q", "batch", str(tmp_path / "bound"), data, str(tmp_path / "batches"), "--steps", "30"]
    assert main([*batch, "--batch-size", "20", "--runner", "local"]) == 0  # a fresh secret key: amplified DP-SGD
    training = ["-q", "train", str(tmp_path / "batches"), "--noise-multiplier", "0.8", "--delta", "1e-5"]
    assert main([*training[:3], str(tmp_path / "first"), *training[3:]]) == 0
    first = json.load(open(tmp_path / "first" / "privacy.json"))
    assert first["private"] and first["relies_on_secret_sampling"] and "composition" not in first
    capsys.readouterr()
    lock = tmp_path / "bound" / LOCK_FILE  # a training of another process, still running (a parallel sweep)
    lock.write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname(), "command": "train", "since": "now"}))
    assert main([*training[:3], str(tmp_path / "parallel"), *training[3:]]) == 2
    assert "being written by another madp process" in capsys.readouterr().err
    lock.unlink()
    assert main([*training[:3], str(tmp_path / "second"), *training[3:]]) == 2
    assert "re-uses it" in capsys.readouterr().err and not (tmp_path / "second" / "privacy.json").exists()
    assert main([*training[:3], str(tmp_path / "second"), *training[3:], "--retrain"]) == 0
    second = json.load(open(tmp_path / "second" / "privacy.json"))
    composed = second["composition"]
    assert composed["trainings"] == 2 and composed["equivalent_noise_multiplier"] == pytest.approx(0.8 / 2**0.5)
    assert composed["epsilon"] > 2 * first["epsilon"], "re-used secret sampling: worse than twice epsilon"
    assert (second["epsilon"], second["delta"]) == (composed["epsilon"], composed["delta"]), (
        "the headline guarantee of a retrained model is the composed one"
    )
    assert second["single_training"]["epsilon"] == pytest.approx(first["epsilon"])
    assert not (tmp_path / "bound" / LOCK_FILE).exists()


@pytest.mark.tf
def test_trainings_on_batches_made_anew_from_one_selection_compose(tmp_path, capsys):
    """The trainings ledger is kept with the selection: a training on another batching of it (a fresh
    key) composes with the first as an independent release (the PLD of both, computed here with
    dp_accounting directly), below what re-using one sampling costs; a second training on the first
    batches is refused in terms of composition, never sent to a new batching as a way out. A batch
    output's own ledger (madp before the selection kept it) still counts."""
    pytest.importorskip("tensorflow")
    from dp_accounting import dp_event
    from dp_accounting.pld import pld_privacy_accountant

    data = write_records(str(tmp_path / "records.jsonl"), rows(400))
    assert main(["-q", "bound", data, str(tmp_path / "bound"), "-k", "1", "--runner", "local"]) == 0

    def batch(name: str) -> int:
        command = ["-q", "batch", str(tmp_path / "bound"), data, str(tmp_path / name), "--steps", "30"]
        return main([*command, "--batch-size", "20", "--runner", "local"])

    for name in ("batches", "again", "old"):  # three batchings of one selection, each with a fresh key
        assert batch(name) == 0

    def train(batches: str, output: str, *extra: str) -> tuple[int, str]:
        sigma = ["--noise-multiplier", "0.8", "--delta", "1e-5"]
        code = main(["-q", "train", str(tmp_path / batches), str(tmp_path / output), *sigma, *extra])
        return code, capsys.readouterr().err

    assert train("batches", "first")[0] == 0
    first = json.load(open(tmp_path / "first" / "privacy.json"))
    assert train("again", "other")[0] == 0
    other = json.load(open(tmp_path / "other" / "privacy.json"))
    composed = other.get("composition") or {}
    assert (composed.get("trainings"), composed.get("independent_batches")) == (2, 1), "not composed with first"
    assert composed["outputs"] == [str(tmp_path / "first")] and other["epsilon"] == composed["epsilon"]
    code, said = train("batches", "second")
    assert code == 2 and "2 earlier private training(s)" in said and "1 of them on these batches" in said
    assert "re-uses it" in said and "compose" in said and "batch again" not in said

    q, steps = first["parameters"]["sampling_prob"], first["parameters"]["steps"]  # K = 1: one record per user

    def pld_epsilon(*sigmas: float) -> float:
        trainings = [
            dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(s)), steps)
            for s in sigmas
        ]
        accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-3)
        accountant.compose(dp_event.ComposedDpEvent(trainings))
        return accountant.get_epsilon(1e-5)

    assert first["epsilon"] == pytest.approx(pld_epsilon(0.8), rel=1e-2)
    assert other["epsilon"] == pytest.approx(pld_epsilon(0.8, 0.8), rel=1e-2)
    assert first["epsilon"] < other["epsilon"] < pld_epsilon(0.8 / 2**0.5), "independent: less than re-used sampling"

    ledger = [json.loads(line) for line in open(tmp_path / "bound" / "trainings.jsonl")]
    assert [entry["output"] for entry in ledger] == [str(tmp_path / "first"), str(tmp_path / "other")]
    older = {k: v for k, v in ledger[0].items() if k not in ("batches", "batch_files", "truncation_probability")}
    (tmp_path / "old" / "trainings.jsonl").write_text(json.dumps({**older, "training": "older", "output": "older"}))
    assert batch("old") == 2, "a new batching there would delete the only record of that training"
    assert "does not hold yet" in capsys.readouterr().err
    code, said = train("old", "third")
    assert code == 2 and "3 earlier private training(s)" in said and "1 of them on these batches" in said
    assert train("old", "third", "--retrain")[0] == 0
    third = json.load(open(tmp_path / "third" / "privacy.json"))["composition"]
    assert (third["trainings"], third["independent_batches"], third["outputs"][0]) == (4, 2, "older")
    ledger = [json.loads(line)["output"] for line in open(tmp_path / "bound" / "trainings.jsonl")]
    assert ledger == ["older", str(tmp_path / "first"), str(tmp_path / "other"), str(tmp_path / "third")]
    assert batch("old") == 0, "its trainings are in the selection's ledger now"
