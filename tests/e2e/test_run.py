"""`madp run`: config validation that names the key, resumable stages, overrides and --force."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest
import yaml
from conftest import crash_at, held_by, snapshot

from madp.cli import main
from madp.core import storage

pytest.importorskip("tensorflow")


def write_config(path, run_dir, **changes) -> str:
    config = {
        "run_dir": str(run_dir),
        "generate": {"records": 3000, "features": 6, "seed": 3, "holdout": True},
        "bound": {"max_contributions": 2, "runner": "local"},
        "batch": {"steps": 30, "batch_size": 50, "min_sep": 2, "runner": "local"},
        "calibrate": {"epsilon": 4, "delta": 1e-5, "bands": 2},
        "train": {"model": "logreg", "eval_every": 10, "eval_data_public": True},  # a synthetic hold-out
    }
    for key, value in changes.items():
        section, _, leaf = key.partition("__")
        if leaf:
            config[section][leaf] = value
        elif value is None:
            config.pop(section, None)
        else:
            config[section] = value
    with open(path, "w") as handle:
        yaml.safe_dump(config, handle)
    return str(path)


def run(capsys, *argv) -> dict:
    assert main(["-q", "run", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def statuses(summary: dict) -> dict:
    return {stage["stage"]: stage["status"] for stage in summary["stages"]}


def digest(directory) -> str:
    hashes = hashlib.sha256()
    for root, _, files in sorted(os.walk(directory)):
        for name in sorted(files):
            if name.endswith((".tfrecord", ".parquet")):
                hashes.update(open(os.path.join(root, name), "rb").read())
    return hashes.hexdigest()


@pytest.mark.slow
def test_stages_run_once_and_rerun_only_what_changed(tmp_path, capsys):
    config = write_config(tmp_path / "job.yaml", tmp_path / "run", batch__seed=11)
    first = run(capsys, config)
    assert set(statuses(first).values()) == {"ran"}
    assert list(statuses(first)) == [
        "generate",
        "bound",
        "verify-bound",
        "batch",
        "verify-batches",
        "calibrate",
        "train",
    ]
    results = first["results"]
    assert results["privacy"]["mechanism"] == "bandmf" and results["privacy"]["epsilon"] <= 4
    assert results["train"]["step"] == 30 and results["bound"]["selected_records"] > 0
    privacy = json.load(open(tmp_path / "run" / "train" / "privacy.json"))
    assert privacy["noise_multiplier"] == results["privacy"]["noise_multiplier"]
    assert privacy["calibration"].endswith("calibration.json")
    batches = digest(tmp_path / "run" / "batches")

    assert set(statuses(run(capsys, config)).values()) == {"skipped"}

    changed = run(capsys, config, "--set", "batch.steps=40")
    assert statuses(changed) == {
        "generate": "skipped",
        "bound": "skipped",
        "verify-bound": "skipped",
        "batch": "ran",
        "verify-batches": "ran",
        "calibrate": "ran",
        "train": "ran",
    }
    assert changed["results"]["train"]["step"] == 40

    forced = run(capsys, config, "--force")
    assert set(statuses(forced).values()) == {"ran"}
    assert digest(tmp_path / "run" / "batches") == batches  # same inputs and explicit seed: the same bytes


def test_an_input_reruns_its_stage_when_its_content_changes(tmp_path, capsys):
    config = write_config(
        tmp_path / "job.yaml", tmp_path / "run", calibrate=None, train=None, generate=None, input=None
    )
    records = tmp_path / "records.jsonl"
    rows = [{"id": i, "users": [i % 40, (i * 7) % 40], "features": [0.1 * i], "label": i % 2} for i in range(400)]
    records.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config_data = yaml.safe_load(open(config))
    config_data["input"] = str(records)
    config_data["batch"].update(steps=5, batch_size=3)
    yaml.safe_dump(config_data, open(config, "w"))
    assert set(statuses(run(capsys, config)).values()) == {"ran"}
    os.utime(records, ns=(1, 1))  # same bytes, other modification time: the same input
    assert set(statuses(run(capsys, config)).values()) == {"skipped"}
    records.write_text(records.read_text().replace('"label": 0}', '"label": 1}', 1))  # content only
    assert set(statuses(run(capsys, config)).values()) == {"ran"}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"bound__order_by": "arity"}, "config bound.order_by: not an option of `madp bound`"),
        ({"bound__max_contributions": 0}, "config bound: --max-contributions must be at least 1"),
        ({"batch__steps": "many"}, "config batch.steps: expected int, got 'many'"),
        ({"batch__sampler": "fancy"}, "config batch.sampler: one of minsep, minsep-greedy, users"),
        ({"calibrate__model": "mlp"}, "config calibrate: model belong to the train section"),
        ({"train__epsilon": 2}, "config train: epsilon belong to the calibrate section"),
        ({"calibrate": None}, "config train: needs a calibrate section"),
        ({"generate__holdout": "yes"}, "config generate.holdout: true or false"),
        ({"bound__runner_options": "--x"}, "config bound.runner_options: a list of the runner's options"),
        ({"bound__partitions": 8}, "a runner option, madp's --partitions among them, goes in runner_options"),
        (
            {"batch__runner": "DirectRunner", "batch__beam_options": ["--partitions", "2"]},
            "config batch.beam_options: the runner's options (Beam's or Spark's) go in batch.runner_options",
        ),
        ({"extra": {"a": 1}}, "config: unknown key(s) extra"),
    ],
)
def test_config_errors_name_the_key_before_anything_runs(tmp_path, capsys, change, message):
    config = write_config(tmp_path / "job.yaml", tmp_path / "run", **change)
    assert main(["-q", "run", config]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_set_needs_key_and_value(tmp_path, capsys):
    config = write_config(tmp_path / "job.yaml", tmp_path / "run")
    assert main(["-q", "run", config, "--set", "bound.max_contributions"]) == 2
    assert "expected key=value" in capsys.readouterr().err


@pytest.mark.slow
def test_a_training_the_ledger_refuses_leaves_the_finished_one_in_place(tmp_path, capsys):
    """DP-SGD on Poisson batches relies on the secret sampling: a second training on them is refused
    unless retrained. A changed train option must not have deleted the finished model first; undone, the
    stage is up to date again; with retrain: true the new training replaces it, logs and all."""
    calibrate = {"noise_multiplier": 2.0, "delta": 1e-5}  # DP-SGD's PLD once, not a search for an epsilon
    config = write_config(tmp_path / "job.yaml", tmp_path / "run", batch__min_sep=1, calibrate=calibrate)
    run(capsys, config)
    train = tmp_path / "run" / "train"
    finished = snapshot(train)
    assert {"model.keras", "metrics.json", "privacy.json"} <= set(finished)
    assert main(["-q", "run", config, "--set", "train.learning_rate=0.1"]) == 2
    assert "--retrain" in capsys.readouterr().err
    assert snapshot(train) == finished
    assert statuses(run(capsys, config))["train"] == "skipped"
    replaced = run(capsys, config, "--set", "train.learning_rate=0.1", "--set", "train.retrain=true")
    assert statuses(replaced)["train"] == "ran"
    assert json.load(open(train / "metrics.json"))["learning_rate"] == 0.1
    assert json.load(open(train / "privacy.json"))["composition"]["trainings"] == 2
    assert len(os.listdir(train / "logs")) == 1  # the earlier training's events replaced, not mixed in


@pytest.mark.slow
def test_a_replacing_training_that_fails_after_its_first_step_gives_the_finished_one_back(
    tmp_path, capsys, caplog, monkeypatch
):
    """A changed train option whose training diverges at its first evaluation (step 10): the finished
    training, set aside at the new one's first step, is back in place, and the stage up to date again. A
    training that finished is done, even where the run stopped before it had checked its inputs again."""
    config = write_config(tmp_path / "job.yaml", tmp_path / "run")
    run(capsys, config)
    train = tmp_path / "run" / "train"
    finished = snapshot(train)
    assert main(["-q", "run", config, "--set", "train.learning_rate=1e38"]) == 2
    assert "its evaluation on --eval-data at step 10 gives {'loss': inf}" in capsys.readouterr().err
    assert "the training it replaced is back in place" in caplog.text
    assert snapshot(train) == finished
    assert statuses(run(capsys, config))["train"] == "skipped"

    # Stopped once the new training has finished, while its inputs are digested again: it is done, not
    # trained a third time by the same command.
    import madp.jobs.run as jobs_run

    digests, digested = jobs_run.fingerprint, []

    def stopped_at_the_second(stage):
        digested.append(stage.name)
        if digested.count("train") == 2:
            raise KeyboardInterrupt
        return digests(stage)

    changed = ["--set", "train.learning_rate=0.05"]
    monkeypatch.setattr(jobs_run, "fingerprint", stopped_at_the_second)
    assert main(["-q", "run", config, *changed]) == 130
    monkeypatch.undo()
    trained = snapshot(train)
    assert json.loads(trained["metrics.json"])["learning_rate"] == 0.05
    assert statuses(run(capsys, config, *changed))["train"] == "skipped" and snapshot(train) == trained


@pytest.mark.slow
def test_a_replacing_training_killed_leaves_the_finished_one_up_to_date_once_the_option_is_undone(
    tmp_path, capsys, monkeypatch
):
    """A changed train option's training killed with no clean-up (SIGKILL: nothing settles the finished training
    it set aside, nor puts the stage's manifest back): the option undone, the run settles the output back to the
    finished training and finds it up to date, instead of training once more over it."""
    config = write_config(tmp_path / "job.yaml", tmp_path / "run")
    run(capsys, config)
    train = tmp_path / "run" / "train"
    finished = snapshot(train)
    trainings = (tmp_path / "run" / "bound" / "trainings.jsonl").read_text()
    from madp.training import trainer

    with monkeypatch.context() as patch:
        crash_at(patch, 15)
        patch.setattr(trainer, "settle_replaced", lambda output: None)
        assert main(["-q", "run", config, "--set", "train.learning_rate=0.05"]) == 130
    capsys.readouterr()
    assert (train / "internal" / "replaced" / "model.keras").read_bytes() == finished["model.keras"]
    assert not (tmp_path / "run" / ".madp" / "train.json").exists()
    summary = run(capsys, config)
    assert statuses(summary)["train"] == "skipped"
    assert snapshot(train) == finished
    killed = (tmp_path / "run" / "bound" / "trainings.jsonl").read_text()[len(trainings) :]
    assert [json.loads(line)["state"] for line in killed.splitlines()] == ["started"]  # no training since


SCALAR_LOSS = """
from madp.training import load_tensorflow
tf = load_tensorflow()
import tf_keras
def build(schema):
    model = tf_keras.Sequential([tf_keras.layers.Dense(1, input_shape=(schema.input_dim,))])
    bce = tf_keras.losses.BinaryCrossentropy(from_logits=True)  # reduces the batch to one number
    return model, lambda y, logits: bce(tf.cast(y[:, None], tf.float32), logits)
"""


@pytest.mark.slow
def test_a_new_training_that_cannot_start_leaves_the_finished_one_in_place(tmp_path, capsys):
    """A changed model whose loss is not per row fails at its first step (when the step is traced): the
    finished model, its logs (the new training's event file has the same name) and privacy.json stay, and
    the stage is up to date again once the change is undone."""
    config = write_config(tmp_path / "job.yaml", tmp_path / "run", train__checkpoint_every=10)
    run(capsys, config)
    train = tmp_path / "run" / "train"
    finished = snapshot(train)
    assert {"model.keras", "metrics.json", "privacy.json"} <= set(finished)
    (tmp_path / "scalarloss.py").write_text(SCALAR_LOSS)
    model = ["--set", "train.model=scalarloss:build", "--set", f"train.model_path={tmp_path}"]
    assert main(["-q", "run", config, *model]) == 2
    assert "the loss gives one number for the whole batch" in capsys.readouterr().err
    assert snapshot(train) == finished
    assert not (train / "internal" / "checkpoints").exists()
    summary = run(capsys, config)
    assert statuses(summary)["train"] == "skipped"
    assert summary["results"]["train"] == json.load(open(train / "metrics.json"))["final"]


def test_an_interrupted_training_is_resumed_and_its_checkpoint_never_cleared(tmp_path, capsys, monkeypatch):
    config = write_config(tmp_path / "job.yaml", tmp_path / "run", train__checkpoint_every=10)
    with monkeypatch.context() as patch:
        crash_at(patch, 15)
        assert main(["-q", "run", config]) == 130  # Ctrl-C: one line, the finished stages kept
    capsys.readouterr()
    state = tmp_path / "run" / "train" / "internal" / "checkpoints" / "state.json"
    assert json.load(open(state))["step"] == 10
    assert main(["-q", "run", config]) == 2  # a fresh training: the checkpoint is the user's to resume or drop
    err = capsys.readouterr().err
    assert "holds a checkpoint of an interrupted training" in err and "train.resume: true" in err
    assert "pass --resume to finish it" in err  # the command line names the option by its flag
    assert json.load(open(state))["step"] == 10
    batches, bound = snapshot(tmp_path / "run" / "batches"), snapshot(tmp_path / "run" / "bound")
    for change, stage in (
        (["--set", "batch.steps=31"], "batch"),  # fresh batches (a fresh key): the checkpoint's plan no more
        (["--set", "bound.max_contributions=3"], "bound"),
        (["--force"], "generate"),
    ):
        assert main(["-q", "run", config, "--set", "train.resume=true", *change]) == 2
        err = capsys.readouterr().err
        assert f"stage {stage} would run again" in err and "holds the checkpoint of an interrupted training" in err
        assert "resume it (train.resume: true)" in err and "move" in err
        assert snapshot(tmp_path / "run" / "batches") == batches and snapshot(tmp_path / "run" / "bound") == bound
        assert json.load(open(state))["step"] == 10
    resumed = run(capsys, config, "--set", "train.resume=true")
    assert statuses(resumed)["train"] == "ran"
    metrics = json.load(open(tmp_path / "run" / "train" / "metrics.json"))
    assert metrics["resumed_at"] == 10 and metrics["final"]["step"] == 30
    assert not state.parent.exists()  # a finished training removes its checkpoints
    # The resumed training is the one its options made: a re-run without resume (or setting another option that
    # says only how to reach it) finds it done instead of training once more, composed with it.
    trainings = (tmp_path / "run" / "bound" / "trainings.jsonl").read_text()
    for how in ([], ["--set", "train.checkpoint_every=5", "--set", "train.retrain=true"]):
        assert statuses(run(capsys, config, *how))["train"] == "skipped"
    assert (tmp_path / "run" / "bound" / "trainings.jsonl").read_text() == trainings


def test_files_of_yours_inside_a_stage_folder_are_never_deleted(tmp_path, capsys):
    config = write_config(tmp_path / "job.yaml", tmp_path / "run")
    run(capsys, config)
    train, records = tmp_path / "run" / "train", tmp_path / "run" / "records"
    (train / "notes.txt").write_text("mine")
    finished = snapshot(train)
    assert main(["-q", "run", config, "--set", "train.eval_every=5"]) == 2
    err = capsys.readouterr().err
    assert "notes.txt" in err and "did not write" in err
    assert snapshot(train) == finished
    held_out = train / "held-out.parquet"  # the user's evaluation data, inside the stage's folder
    shutil.copy(tmp_path / "run" / "test.parquet", held_out)
    assert main(["-q", "run", config, "--set", f"train.eval_data={held_out}"]) == 2
    assert f"overlaps input {held_out}" in capsys.readouterr().err
    assert held_out.exists()
    (records / "notes.txt").write_text("mine")
    assert main(["-q", "run", config, "--set", "generate.shards=2"]) == 2
    assert "notes.txt" in capsys.readouterr().err and (records / "notes.txt").exists()
    (records / "notes.txt").unlink()
    (train / "notes.txt").unlink()
    held_out.unlink()
    assert set(statuses(run(capsys, config, "--set", "generate.shards=2")).values()) == {"ran"}
    assert sorted(os.listdir(records)) == ["part-00000-of-00002.parquet", "part-00001-of-00002.parquet"]


@pytest.mark.slow
def test_a_stage_folder_another_process_writes_is_left_to_it(tmp_path, capsys, other_process):
    """A standalone `madp train` writing run_dir/train (its lock, logs and a checkpoint): the run stops with
    one error naming it, and nothing of it is deleted."""
    config = write_config(tmp_path / "job.yaml", tmp_path / "run")
    run(capsys, config)
    train = tmp_path / "run" / "train"
    (train / "internal" / "checkpoints").mkdir()
    (train / "internal" / "checkpoints" / "ckpt-5.index").write_bytes(b"a checkpoint")
    (train / storage.LOCK_FILE).write_text(held_by(other_process, "train"))
    held = snapshot(train)
    assert main(["-q", "run", config, "--set", "train.eval_every=5"]) == 2
    err = capsys.readouterr().err
    assert "is being written by another madp process" in err and f"pid {other_process}" in err
    assert "Traceback" not in err
    assert snapshot(train) == held
