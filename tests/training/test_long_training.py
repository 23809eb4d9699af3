"""What a long `madp train` job needs: published and internal TensorBoard scalars, learning-rate
schedules, and checkpoints a job resumes from without reusing noise or writing the noise key."""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import re
import shutil
import socket
import time
import zipfile

import numpy as np
import pytest

pytest.importorskip("tensorflow")

from conftest import crash_at, snapshot, write_records  # noqa: E402

import madp.training.api as api  # noqa: E402
import madp.training.trainer as trainer  # noqa: E402
from madp.core.errors import DiskFull, InputError  # noqa: E402
from madp.core.options import error_text  # noqa: E402
from madp.core.randomness import SecretKey  # noqa: E402
from madp.core.selection import BoundOptions  # noqa: E402
from madp.engines.batch_local import run_local as batch_local  # noqa: E402
from madp.engines.batching import BatchOptions  # noqa: E402
from madp.engines.local_engine import run_local as bound_local  # noqa: E402
from madp.tools.data.synthetic import GraphSpec, generate, to_table  # noqa: E402
from madp.training.long_training import after_stop, epsilon_spent, learning_rate_at  # noqa: E402
from madp.training.options import TrainOptions  # noqa: E402
from madp.training.outputs import evaluation_of  # noqa: E402
from madp.training.plan import stated_plan  # noqa: E402
from madp.training.queries import key_tensor  # noqa: E402

tf = pytest.importorskip("tensorflow")
pytestmark = [pytest.mark.tf]

INTERNAL_TAGS = {"train/loss", "train/clipped_fraction", "train/gradient_norm_mean"}
STEPS = 12


@pytest.fixture(scope="module")
def batches(tmp_path_factory):
    """Small 2-min-sep Poisson batches: BandMF with 2 bands (noise history) trains on them."""
    directory = tmp_path_factory.mktemp("long")
    rows = to_table(generate(GraphSpec(records=1500, graph="skewed", features=8, seed=3))).to_pylist()
    data = write_records(str(directory / "records.jsonl"), rows)
    bound_local(data, str(directory / "bounded"), BoundOptions(max_contributions=2))
    out = str(directory / "batches")
    batch_local(
        str(directory / "bounded"),
        data,
        out,
        BatchOptions(seed=0, steps=STEPS, batch_size=32, min_sep=2, max_batch_size=64),
    )
    return directory, out, data


def next_step(step, steps: list[dict]) -> None:
    """The step object's next step, on all that step's rows (`steps`: read_steps' of its batches)."""
    rows = steps[step.steps_taken]
    step(rows["features"], rows["label"], rows["weight"], index=rows["step"])


def tags(directory: str) -> dict[str, list[tuple[int, float]]]:
    """The scalars of the TensorBoard event files directly in `directory`: tag -> [(step, value)]."""
    found: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(glob.glob(os.path.join(directory, "events.*"))):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                found.setdefault(value.tag, []).append((event.step, float(tf.make_ndarray(value.tensor))))
    return found


def weights(output: str) -> list[np.ndarray]:
    import tf_keras

    return tf_keras.models.load_model(os.path.join(output, "model.keras"), compile=False).get_weights()


def test_learning_rate_schedules():
    def rates(schedule, warmup=0):
        options = TrainOptions(mechanism="none", lr_schedule=schedule, warmup_steps=warmup, learning_rate=0.4)
        return [learning_rate_at(t, 10, options) for t in range(10)]

    assert rates("constant") == [0.4] * 10
    assert rates("cosine")[0] == 0.4 and rates("cosine")[5] == pytest.approx(0.2)
    assert all(a > b for a, b in zip(rates("cosine"), rates("cosine")[1:]))
    warm = rates("warmup-cosine", warmup=4)
    assert warm[:5] == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.4])
    assert warm[7] == pytest.approx(0.4 * 0.5 * (1 + math.cos(math.pi * 3 / 6)))
    with pytest.raises(InputError, match="^warmup_steps must be at least 0, and above 0 only with lr_schedule"):
        TrainOptions(mechanism="none", warmup_steps=3)
    with pytest.raises(InputError, match="^lr_schedule must be one of constant, cosine, warmup-cosine"):
        TrainOptions(mechanism="none", lr_schedule="step")


def test_optimizer_learning_rate_follows_the_schedule(batches, monkeypatch):
    directory, out, _ = batches
    seen: list[float] = []
    original = trainer.set_learning_rate

    def recording(optimizer, value):
        original(optimizer, value)
        seen.append(float(optimizer.learning_rate.numpy()))  # what apply_gradients reads

    monkeypatch.setattr(trainer, "set_learning_rate", recording)
    options = TrainOptions(
        noise_multiplier=1.0, bands=2, noise_seed=1, lr_schedule="warmup-cosine", warmup_steps=3, eval_every=4
    )
    result = trainer.train(out, str(directory / "scheduled"), options)
    assert seen == pytest.approx([learning_rate_at(t, STEPS, options) for t in range(STEPS)], rel=1e-6)
    assert result.metrics.settings["lr_schedule"] == "warmup-cosine" and result.metrics.settings["warmup_steps"] == 3
    logged = tags(str(directory / "scheduled" / "logs"))["train/learning_rate"]
    assert [step for step, _ in logged] == [4, 8, 12]


def test_published_outputs_carry_no_internal_scalars(batches):
    directory, out, data = batches
    output = str(directory / "scalars")
    options = TrainOptions(noise_multiplier=1.0, bands=2, eval_data=data, eval_every=4, internal_scalars=True)
    trainer.train(out, output, options)
    internal = tags(os.path.join(output, "internal", "logs"))
    evaluations = {"eval/loss", "eval/accuracy"}  # on the training's own records: internal too
    assert set(internal) == INTERNAL_TAGS | evaluations and [s for s, _ in internal["train/loss"]] == [4, 8, 12]
    assert all(0 <= v <= 1 for _, v in internal["train/clipped_fraction"])
    assert "INTERNAL" in open(os.path.join(output, "internal", "NOTICE.txt")).read()
    # Nothing outside internal/ holds an internal scalar: neither the TensorBoard logs nor the JSON files.
    published = tags(os.path.join(output, "logs"))
    assert set(published) == {"privacy/epsilon_spent"}
    for path in glob.glob(os.path.join(output, "**", "*"), recursive=True):
        if os.path.isfile(path) and not os.path.relpath(path, output).startswith("internal"):
            if path.endswith(".json"):
                assert not any(tag.split("/")[1] in open(path).read() for tag in INTERNAL_TAGS - {"train/loss"})
            elif "events" in os.path.basename(path):
                assert not set(tags(os.path.dirname(path))) & INTERNAL_TAGS
    # Epsilon spent grows with the steps and, after T, is the plan's (up to the coarser PLD grid).
    spent = [v for _, v in published["privacy/epsilon_spent"]]
    plan = stated_plan(json.load(open(os.path.join(output, "privacy.json"))))
    assert plan is not None and spent == sorted(spent) and spent[-1] == pytest.approx(plan.epsilon, rel=0.05)
    assert spent[-1] >= plan.epsilon  # the coarser grid only adds
    assert spent[-1] == pytest.approx(epsilon_spent(plan, STEPS), rel=1e-6)


def test_tensorboard_scalars_and_the_model_carry_no_clock_time(batches, monkeypatch):
    """Every event's wall_time is its step, and each event file is named by the step its training starts
    at: no start time, host or process id (tf.summary's writer puts all three there and stamps each
    event with the time it was written, which would time every step). TensorBoard reads the scalars,
    and a resumed training's file sorts after the interrupted one's. model.keras holds no time of
    saving (Keras writes it into metadata.json and the weights' zip entry)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    directory, out, _ = batches
    output = str(directory / "stamped")
    options = TrainOptions(noise_multiplier=1.0, bands=2, lr_schedule="cosine", checkpoint_every=4, eval_every=4)
    started = time.time()
    crash_at(monkeypatch, 6)
    with pytest.raises(KeyboardInterrupt):
        trainer.train(out, output, options)
    monkeypatch.undo()
    plan = stated_plan(trainer.train(out, output, TrainOptions(**{**vars(options), "resume": True})).privacy)
    ended = time.time()
    logs = os.path.join(output, "logs")
    names = sorted(os.listdir(logs))
    assert names == ["events.out.tfevents.0000000000.madp", "events.out.tfevents.0000000004.madp"]
    for name, first_step in zip(names, (0, 4)):
        assert socket.gethostname() not in name and str(os.getpid()) not in name
        assert not any(started - 1 <= int(number) <= ended + 1 for number in re.findall(r"\d+", name))
        events = list(tf.compat.v1.train.summary_iterator(os.path.join(logs, name)))
        assert events[0].file_version and events[0].wall_time == first_step
        assert all(event.wall_time == event.step for event in events[1:]) and len(events) > 1
    scalars = EventAccumulator(logs).Reload()
    assert set(scalars.Tags()["tensors"]) == {"privacy/epsilon_spent", "train/learning_rate"}
    spent = scalars.Tensors("privacy/epsilon_spent")
    assert [(e.step, e.wall_time) for e in spent] == [(4, 4.0), (8, 8.0), (12, 12.0)]
    for event in spent:
        assert float(tf.make_ndarray(event.tensor_proto)) == pytest.approx(epsilon_spent(plan, event.step), rel=1e-6)
    rates = [float(tf.make_ndarray(e.tensor_proto)) for e in scalars.Tensors("train/learning_rate")]
    assert rates == pytest.approx([learning_rate_at(step - 1, STEPS, options) for step in (4, 8, 12)], rel=1e-6)
    with zipfile.ZipFile(os.path.join(output, "model.keras")) as archive:
        assert {entry.date_time for entry in archive.infolist()} == {(1980, 1, 1, 0, 0, 0)}
        assert json.loads(archive.read("metadata.json"))["date_saved"] == "1980-01-01@00:00:00"
    assert len(weights(output)) == 2  # it loads


def test_epsilon_spent_pairs_with_the_plans_delta_truncation_share_included(batches):
    """Amplified DP-SGD on truncated batches: the mechanism gets delta less truncation's share, so
    epsilon spent after T steps is the plan's, never below it."""
    directory, _, data = batches
    poisson = str(directory / "poisson")  # min-sep 1, truncated to B_max 68: amplified DP-SGD
    batch_local(
        str(directory / "bounded"), data, poisson, BatchOptions(seed=0, steps=50, batch_size=32, max_batch_size=68)
    )
    plan = api.calibrate(api.open_batches(poisson), epsilon=2.0, delta=1e-5)
    assert plan.truncation_delta > 0
    assert plan.mechanism == "dpsgd"
    assert epsilon_spent(plan, 50) == pytest.approx(plan.epsilon, rel=0.01)
    assert epsilon_spent(plan, 50) >= plan.epsilon  # at the whole delta it was 1.959 against 1.998


def test_interrupted_run_resumes_with_a_fresh_key_and_no_noise_key_written(batches, monkeypatch):
    directory, out, data = batches
    options = TrainOptions(
        noise_multiplier=1.0, bands=2, noise_seed=5, checkpoint_every=4, eval_data=data, eval_every=4
    )
    whole = str(directory / "whole")
    trainer.train(out, whole, options)
    assert not os.path.exists(os.path.join(whole, "internal", "checkpoints"))  # removed when done

    # Interrupted after step 6: the checkpoint of step 4 remains, steps 5 and 6 are lost (never published).
    cut = str(directory / "cut")
    crash_at(monkeypatch, 6)
    with pytest.raises(KeyboardInterrupt):
        trainer.train(out, cut, options)
    monkeypatch.undo()
    checkpoints = os.path.join(cut, "internal", "checkpoints")
    assert json.load(open(os.path.join(checkpoints, "state.json")))["step"] == 4
    key = key_tensor(SecretKey.from_seed(5, "training noise")).numpy()
    checkpoint = tf.train.latest_checkpoint(checkpoints)
    for name, _ in tf.train.list_variables(checkpoint):
        assert "key" not in name.lower()
        value = tf.train.load_variable(checkpoint, name)
        assert not (np.shape(value) == key.shape and np.array_equal(value, key))
    with pytest.raises(InputError, match="pass resume"):  # a fresh run would lose track of the interrupted one
        trainer.train(out, cut, options)

    # Resumed with the interrupted run's own key, the result is the uninterrupted model: the checkpoint
    # holds all the state (model, optimizer, BandMF history, noise step).
    same_key = str(directory / "same-key")
    shutil.copytree(cut, same_key)
    for_run = SecretKey.for_run
    monkeypatch.setattr(api.SecretKey, "for_run", lambda seed, purpose, option: for_run(seed, "training noise", option))
    trainer.train(out, same_key, TrainOptions(**{**vars(options), "resume": True}))
    monkeypatch.setattr(api.SecretKey, "for_run", for_run)
    for a, b in zip(weights(whole), weights(same_key)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

    # As madp resumes: a new key for the remaining steps, so their noise (and the model) differ.
    result = trainer.train(out, cut, TrainOptions(**{**vars(options), "resume": True}))
    assert result.metrics.settings["steps"] == STEPS and result.metrics.settings["resumed_at"] == 4
    assert [m["step"] for m in evaluation_of(cut, internal=True)["eval"]] == [4, 8, 12]
    assert not all(np.allclose(a, b) for a, b in zip(weights(whole), weights(cut)))
    assert not os.path.exists(checkpoints)
    with pytest.raises(InputError, match="no checkpoint"):
        trainer.train(out, cut, TrainOptions(**{**vars(options), "resume": True}))


def test_resumed_step_counts_from_the_checkpoint_and_draws_other_noise(batches):
    _, out, _ = batches
    import tf_keras

    from madp.training.tasks import build_model

    batches_ = api.open_batches(out)
    plan = api.calibrate(batches_, noise_multiplier=1.0, bands=2)
    model, loss = build_model("logreg", 8)
    first = api.make_private(model, loss, tf_keras.optimizers.SGD(0.1), plan, noise_seed=5)
    resumed = api.make_private(model, loss, tf_keras.optimizers.SGD(0.1), plan, noise_seed=5, resumed_at=10)
    assert resumed.steps_taken == 10 and first.query._clipping._key != resumed.query._clipping._key
    steps = list(api.read_steps(batches_, ["features", "label"]))
    next_step(resumed, steps)
    next_step(resumed, steps)
    last = steps[-1]
    with pytest.raises(InputError, match="12 steps"):
        resumed(last["features"], last["label"], last["weight"], index=last["step"])


def test_step_statistics_measure_the_records_with_weight():
    import tf_keras

    from madp.training.clipping import per_example_gradients
    from madp.training.long_training import step_statistics
    from madp.training.tasks import build_model

    tf_keras.utils.set_random_seed(0)
    model, loss = build_model("logreg", 4)
    x = np.random.default_rng(0).normal(size=(6, 4)).astype(np.float32) * 3
    y = np.array([0, 1, 0, 1, 1, 0], np.float32)
    weight = np.array([1, 1, 1, 1, 0, 0], np.float32)  # two padding rows: not records
    norms = np.sqrt(
        sum(np.sum(np.reshape(g, (6, -1)) ** 2, axis=1) for g in per_example_gradients(model, loss, x, y, weight))
    )
    stats = step_statistics(model, loss, x, y, weight, None, clip_norm=float(np.median(norms[:4])))
    assert stats["gradient_norm_mean"] == pytest.approx(norms[:4].mean(), rel=1e-5)
    assert stats["clipped_fraction"] == 0.5
    assert stats["loss"] == pytest.approx(float(np.sum(loss(y, model(x)).numpy() * weight)) / 4, rel=1e-5)
    assert step_statistics(model, loss, x[:0], y[:0], weight[:0], None, 1.0)["loss"] == 0.0


def test_cli_takes_the_long_job_options(batches):
    from madp.cli import main

    directory, out, _ = batches
    output = str(directory / "cli")
    command = ["-q", "train", out, output, "--noise-multiplier", "1", "--bands", "2", "--noise-seed", "1"]
    long = ["--lr-schedule", "cosine", "--checkpoint-every", "5", "--internal-scalars", "--eval-every", "6"]
    assert main([*command, *long]) == 0
    assert json.load(open(os.path.join(output, "metrics.json")))["lr_schedule"] == "cosine"
    assert set(tags(os.path.join(output, "internal", "logs"))) == INTERNAL_TAGS


def test_a_new_training_into_an_output_holding_another_trainings_logs_is_refused(batches):
    directory, out, _ = batches
    output = str(directory / "twice")
    trainer.train(out, output, TrainOptions(mechanism="none"))
    with pytest.raises(InputError, match="holds the logs of an earlier training"):
        trainer.train(out, output, TrainOptions(noise_multiplier=1.0, bands=2, retrain=True))


# --- the trainings ledger: a training counts from its first step ---------------------------------


def fresh_copy(out: str, directory) -> str:
    """A copy of the batches and of the selection they were made from (its report names the copy), whose
    ledger holds no training yet: this module's trainings stay apart."""
    copy, selection = str(directory / "batches"), str(directory / "bounded")
    shutil.copytree(out, copy)
    report_path = os.path.join(copy, "report.json")
    report = json.load(open(report_path))
    shutil.copytree(report["selected"], selection)
    with open(report_path, "w") as handle:
        json.dump({**report, "selected": selection}, handle)
    for leftover in (os.path.join(copy, "trainings.jsonl"), ledger_path(copy)):
        if os.path.exists(leftover):
            os.remove(leftover)
    return copy


def ledger_path(batches_dir: str) -> str:
    """The trainings ledger of the batches: beside the selection they were made from."""
    return os.path.join(json.load(open(os.path.join(batches_dir, "report.json")))["selected"], "trainings.jsonl")


def ledger(batches_dir: str) -> list[dict]:
    path = ledger_path(batches_dir)
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


def assert_nothing_entered_and_the_next_training_starts_alone(failed, model, initial, copy, plan, steps) -> None:
    """After a first step that raised: no ledger entry, no step taken, the model's weights as they were; a
    new training on the same plan composes with nothing and is entered once its first step runs."""
    import tf_keras

    from madp.training.tasks import build_model

    assert ledger(copy) == [] and failed.steps_taken == 0
    for a, b in zip(model.get_weights(), initial):
        np.testing.assert_array_equal(a, b)
    model, loss = build_model("logreg", 8)
    after = api.make_private(model, loss, tf_keras.optimizers.SGD(0.1), plan)
    assert after.plan.composition is None, "no earlier training: the failed one released nothing"
    next_step(after, steps)
    assert [(t["training"], t["state"]) for t in ledger(copy)] == [(after.training, "started")]


def crash_writing_state(monkeypatch, step: int) -> None:
    """Interrupt madp train as it writes the state.json of its checkpoint of `step`."""
    from madp.training import long_training

    write = long_training.storage.write_text

    def crash(path, text):
        if path.endswith("/state.json") and json.loads(text)["step"] == step:
            raise KeyboardInterrupt
        write(path, text)

    monkeypatch.setattr(long_training.storage, "write_text", crash)


def test_an_interrupted_training_is_composed_with_by_the_next_one(batches, tmp_path, monkeypatch):
    """Interrupted at step 6 without a checkpoint: the evaluation of step 4 was written, so the
    training is in the ledger since its first step and the next training states their composition."""
    _, out, data = batches
    copy = fresh_copy(out, tmp_path)
    options = TrainOptions(noise_multiplier=1.0, bands=2, eval_data=data, eval_every=4)
    cut = str(tmp_path / "cut")
    crash_at(monkeypatch, 6)
    with pytest.raises(KeyboardInterrupt):
        trainer.train(copy, cut, options)
    monkeypatch.undo()
    assert tags(os.path.join(cut, "internal", "logs"))["eval/loss"][0][0] == 4, "step 4's evaluation was written"
    [entry] = ledger(copy)
    assert (entry["output"], entry["state"], entry["noise_multiplier"]) == (cut, "started", 1.0)

    after = trainer.train(copy, str(tmp_path / "after"), options).privacy
    assert after["composition"]["trainings"] == 2 and after["composition"]["outputs"] == [cut]
    assert after["epsilon"] > after["single_training"]["epsilon"]
    assert [t["state"] for t in ledger(copy)] == ["started", "finished"]


def test_a_resumed_training_continues_its_own_entry(batches, tmp_path, monkeypatch):
    _, out, data = batches
    copy = fresh_copy(out, tmp_path)
    options = TrainOptions(noise_multiplier=1.0, bands=2, checkpoint_every=4, eval_data=data, eval_every=4)
    cut = str(tmp_path / "cut")
    crash_at(monkeypatch, 6)
    with pytest.raises(KeyboardInterrupt):
        trainer.train(copy, cut, options)
    monkeypatch.undo()
    [started] = ledger(copy)
    unseen = write_records(str(tmp_path / "unseen.jsonl"), [{"id": 10**9, "features": [0.0] * 8, "label": 1}])
    public = TrainOptions(**{**vars(options), "resume": True, "eval_data": unseen, "eval_data_public": True})
    with pytest.raises(InputError, match=r"no eval_data_public \(this run: eval_data_public\)"):
        trainer.train(copy, cut, public)  # it would publish the evaluations kept internal so far
    backup = str(tmp_path / "backup")
    shutil.copytree(cut, backup)  # the checkpoint of step 4
    # Interrupted again before its next checkpoint: steps 5-7 were never released (a checkpoint precedes
    # every evaluation), so madp train may continue from step 4 once more.
    crash_at(monkeypatch, 7)
    with pytest.raises(KeyboardInterrupt):
        trainer.train(copy, cut, TrainOptions(**{**vars(options), "resume": True}))
    monkeypatch.undo()
    assert ledger(copy)[0]["resumable_from"] == 4
    crash_at(monkeypatch, 10)  # after the checkpoint and evaluation of step 8
    with pytest.raises(KeyboardInterrupt):
        trainer.train(copy, cut, TrainOptions(**{**vars(options), "resume": True}))
    monkeypatch.undo()
    assert ledger(copy)[0]["resumable_from"] == 8
    with pytest.raises(InputError, match="continued or run past step 4 already"):
        trainer.train(copy, backup, TrainOptions(**{**vars(options), "resume": True}))  # would publish step 8 again
    resumed = trainer.train(copy, cut, TrainOptions(**{**vars(options), "resume": True}))
    assert "composition" not in resumed.privacy, "a resumed training is not composed with itself"
    [finished] = ledger(copy)
    assert finished["training"] == started["training"] and finished["state"] == "finished"


def contents(directory: str) -> dict[str, bytes | None]:
    """What a folder holds directly: each file's bytes, None for a folder."""
    paths = {name: os.path.join(directory, name) for name in os.listdir(directory)}
    return {name: open(path, "rb").read() if os.path.isfile(path) else None for name, path in paths.items()}


@pytest.mark.parametrize("runner", ["local", pytest.param("DirectRunner", marks=pytest.mark.beam)])
def test_a_new_batching_of_the_batches_an_interrupted_training_resumes_on_is_refused(
    batches, tmp_path, capsys, monkeypatch, runner
):
    """A stand-alone `madp batch` replaced the batches an interrupted training keeps the checkpoint of a step
    on (only `madp run` refused it), and a resume then went on, on other batches than those of its first
    steps. Refused before anything of BATCHES is written or deleted, naming the checkpoint and the ways out;
    once the training has resumed and finished, the batching runs."""
    from madp.cli import main

    _, out, data = batches
    copy = fresh_copy(out, tmp_path)
    cut = str(tmp_path / "cut")
    train = ["-q", "train", copy, cut, "--noise-multiplier", "1", "--bands", "2", "--checkpoint-every", "4"]
    crash_at(monkeypatch, 6)
    assert main(train) == 130
    monkeypatch.undo()
    assert [entry["state"] for entry in ledger(copy)] == ["started"]
    capsys.readouterr()
    made = contents(copy)
    selection = str(tmp_path / "bounded")
    batch = ["-q", "batch", selection, data, copy, "--steps", str(STEPS), "--batch-size", "32", "--runner", runner]
    assert main(batch) == 2
    err = capsys.readouterr().err
    checkpoint = os.path.join(cut, "internal", "checkpoints")
    assert f"madp batch: error: {checkpoint} holds the checkpoint of an interrupted training: a new batching " in err
    assert "with --resume" in err and "batch into another OUTPUT" in err and f"move {checkpoint} away" in err
    assert contents(copy) == made  # no batch file, report or staging folder written or deleted
    assert main([*train, "--resume"]) == 0
    assert [entry["state"] for entry in ledger(copy)] == ["finished"]
    assert main(batch) == 0


def test_a_resume_on_batches_made_again_since_the_training_started_is_refused(batches, tmp_path, capsys, monkeypatch):
    """With the checkpoint moved away, `madp batch` makes the batches again (the same options, a fresh secret
    key); moved back, `--resume` went on under the same plan on the new batches, and the ledger entry named
    only them: a BandMF training whose steps came from two samplings, min-separation unchecked across them.
    Refused, and the checkpoint and the entry stay as they were."""
    from madp.cli import main

    _, out, data = batches
    fresh_copy(out, tmp_path)  # a selection of this test's own, with no training in its ledger
    made, cut = str(tmp_path / "made"), str(tmp_path / "cut")
    batch = ["-q", "batch", str(tmp_path / "bounded"), data, made, "--steps", str(STEPS), "--batch-size", "32"]
    batch += ["--min-sep", "2", "--max-batch-size", "64", "--runner", "local"]
    assert main(batch) == 0
    train = ["-q", "train", made, cut, "--noise-multiplier", "1", "--bands", "2", "--checkpoint-every", "4"]
    crash_at(monkeypatch, 6)
    assert main(train) == 130
    monkeypatch.undo()
    checkpoint, aside = os.path.join(cut, "internal", "checkpoints"), str(tmp_path / "aside")
    shutil.move(checkpoint, aside)
    first = contents(made)
    assert main(batch) == 0
    assert contents(made) != first
    shutil.move(aside, checkpoint)
    capsys.readouterr()
    [entry] = ledger(made)
    kept = contents(checkpoint)
    assert main([*train, "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"trained on other batch files than {made} holds now (batched again since it started)" in err
    assert ledger(made) == [entry] and contents(checkpoint) == kept


def test_a_resume_with_options_other_than_the_interrupted_trainings_is_refused(batches, tmp_path, capsys, monkeypatch):
    """Interrupted at --learning-rate 0.05 and resumed with the default rate, --resume went on and metrics.json
    recorded the resumed run's rate as the training's. Refused before anything is written, each option named by
    its flag; the same options (a run-only one aside) finish it."""
    from madp.cli import main

    _, out, data = batches
    copy = fresh_copy(out, tmp_path)
    output = str(tmp_path / "train")
    train = ["-q", "train", copy, output, "--noise-multiplier", "1", "--bands", "2", "--checkpoint-every", "4"]
    train += ["--eval-data", data, "--eval-every", "4"]
    crash_at(monkeypatch, 6)
    assert main([*train, "--learning-rate", "0.05"]) == 130
    monkeypatch.undo()
    capsys.readouterr()
    kept, [entry] = snapshot(output), ledger(copy)
    checkpoints = os.path.join(output, "internal", "checkpoints")
    assert main([*train, "--resume"]) == 2
    err = capsys.readouterr().err
    assert "--learning-rate 0.05 (this run: no --learning-rate)" in err and err.count("(this run:") == 1
    assert f"Resume with its options, or move {checkpoints} away to train afresh" in err
    assert snapshot(output) == kept and ledger(copy) == [entry]
    assert main([*train, "--resume", "--learning-rate", "0.5", "--model", "mlp", "--l2", "0.01"]) == 2
    err = capsys.readouterr().err
    assert (
        "--model logreg (this run: --model mlp)" in err
        and "--learning-rate 0.05 (this run: --learning-rate 0.5)" in err
    )
    assert "no --l2 (this run: --l2 0.01)" in err and err.count("(this run:") == 3
    assert snapshot(output) == kept and ledger(copy) == [entry]

    assert main([*train, "--resume", "--learning-rate", "0.05", "--internal-scalars"]) == 0
    metrics = json.load(open(os.path.join(output, "metrics.json")))
    assert metrics["resumed_at"] == 4 and metrics["learning_rate"] == 0.05 and not os.path.exists(checkpoints)
    assert [(t["training"], t["state"]) for t in ledger(copy)] == [(entry["training"], "finished")]


def test_a_checkpoint_without_the_options_of_its_training_resumes_as_it_did(batches, tmp_path, monkeypatch):
    """A checkpoint of a madp that did not record the training's options in state.json: a resume compares its
    evaluation data (and its plan) only."""
    _, out, data = batches
    copy = fresh_copy(out, tmp_path)
    output = str(tmp_path / "train")
    options = TrainOptions(noise_multiplier=1.0, bands=2, checkpoint_every=4, eval_data=data, eval_every=4)
    crash_at(monkeypatch, 6)
    with pytest.raises(KeyboardInterrupt):
        trainer.train(copy, output, options)
    monkeypatch.undo()
    for state_file in glob.glob(os.path.join(output, "internal", "checkpoints", "*state.json")):
        state = json.load(open(state_file))
        del state["options"]
        with open(state_file, "w") as handle:
            json.dump({**state, "evaluated_on": {"eval_data": data, "eval_data_public": False}}, handle)
    with pytest.raises(InputError, match="resume with the same eval_data and eval_data_public") as refused:
        trainer.train(copy, output, TrainOptions(**{**vars(options), "resume": True, "eval_data": None}))
    assert error_text(refused.value).endswith("resume with the same --eval-data and --eval-data-public")
    resumed = trainer.train(copy, output, TrainOptions(**{**vars(options), "resume": True, "learning_rate": 0.05}))
    assert resumed.metrics.settings["resumed_at"] == 4


def test_a_crash_between_a_checkpoint_and_its_ledger_write_leaves_one_checkpoint_to_continue(
    batches, tmp_path, monkeypatch
):
    """A checkpoint of step 8 whose ledger write never happened is not resumed from (state.json stays at
    step 4): a copy of step 4 that continued and released step 8 meanwhile is the only branch. One whose
    ledger write happened is resumed from, and the copy of step 4 is refused."""
    from madp.training.api import PrivateTrainingStep

    _, out, data = batches
    options = TrainOptions(noise_multiplier=1.0, bands=2, checkpoint_every=4, eval_data=data, eval_every=4)
    resume = TrainOptions(**{**vars(options), "resume": True})

    def interrupted(batches_dir: str, output: str, crash) -> None:
        crash_at(monkeypatch, 6)  # after the checkpoint and evaluation of step 4
        with pytest.raises(KeyboardInterrupt):
            trainer.train(batches_dir, output, options)
        monkeypatch.undo()
        shutil.copytree(output, output + "-backup")  # the checkpoint of step 4
        crash(monkeypatch)
        with pytest.raises(KeyboardInterrupt):
            trainer.train(batches_dir, output, resume)
        monkeypatch.undo()

    def before_the_ledger(monkeypatch) -> None:
        recorded = PrivateTrainingStep.checkpointed

        def crash(self):
            if self.steps_taken == 8:
                raise KeyboardInterrupt
            recorded(self)

        monkeypatch.setattr(PrivateTrainingStep, "checkpointed", crash)

    copy, cut = fresh_copy(out, tmp_path), str(tmp_path / "cut")
    interrupted(copy, cut, before_the_ledger)
    assert ledger(copy)[0]["resumable_from"] == 4
    crash_at(monkeypatch, 10)  # the copy of step 4 continues: the checkpoint and evaluation of step 8
    with pytest.raises(KeyboardInterrupt):
        trainer.train(copy, cut + "-backup", resume)
    monkeypatch.undo()
    assert ledger(copy)[0]["resumable_from"] == 8
    with pytest.raises(InputError, match="continued or run past step 4 already"):
        trainer.train(copy, cut, resume)  # its own step 8 would publish steps 5-8 again with other noise

    (tmp_path / "second").mkdir()
    copy, cut = fresh_copy(out, tmp_path / "second"), str(tmp_path / "second" / "cut")
    interrupted(copy, cut, lambda monkeypatch: crash_writing_state(monkeypatch, 8))  # after the ledger's write
    assert ledger(copy)[0]["resumable_from"] == 8
    states = glob.glob(os.path.join(cut + "-backup", "internal", "checkpoints", "*state.json"))
    written = {path: open(path, "rb").read() for path in states}
    with pytest.raises(InputError, match="continued or run past step 4 already"):
        trainer.train(copy, cut + "-backup", resume)
    assert len(written) == 2 and all(open(path, "rb").read() == text for path, text in written.items())
    crash_at(monkeypatch, 10)  # resumed from step 8 (which the ledger names), interrupted again
    with pytest.raises(KeyboardInterrupt):
        trainer.train(copy, cut, resume)
    monkeypatch.undo()
    resumed = trainer.train(copy, cut, resume)  # from step 8 again: state.json took next_state.json's place
    written = resumed.metrics.settings["output"]
    assert [entry["step"] for entry in evaluation_of(written, internal=True)["eval"]] == [4, 8, 12]
    assert ledger(copy)[0]["state"] == "finished"


def test_a_crash_at_the_first_checkpoint_resumes_from_it_and_a_damaged_state_is_an_error(
    batches, tmp_path, monkeypatch
):
    """A crash between the ledger write of the first checkpoint and its state.json (none before it):
    the resume takes next_state.json, which the ledger names. A copy of OUTPUT resumes its own files
    after the original moved. A damaged state file is an InputError naming it."""

    _, out, data = batches
    copy, cut = fresh_copy(out, tmp_path), str(tmp_path / "cut")
    options = TrainOptions(noise_multiplier=1.0, bands=2, checkpoint_every=4, eval_data=data, eval_every=4)
    crash_writing_state(monkeypatch, 4)
    with pytest.raises(KeyboardInterrupt):
        trainer.train(copy, cut, options)
    monkeypatch.undo()
    checkpoints = os.path.join(cut, "internal", "checkpoints")
    assert not os.path.exists(os.path.join(checkpoints, "state.json")) and ledger(copy)[0]["resumable_from"] == 4
    resume = TrainOptions(**{**vars(options), "resume": True})
    bad_evaluation = {"step": 4, "checkpoint": "ckpt-4", "eval": [4], "plan": None}
    for damage in ("{not json", b"\xff\xfe", json.dumps({"step": 4}), json.dumps(bad_evaluation)):
        shutil.copytree(cut, cut + "-damaged", dirs_exist_ok=True)
        target = os.path.join(cut + "-damaged", "internal", "checkpoints", "next_state.json")
        with open(target, "wb") as handle:
            handle.write(damage if isinstance(damage, bytes) else damage.encode())
        with pytest.raises(InputError, match="next_state.json.*not a checkpoint state madp wrote"):
            trainer.train(copy, cut + "-damaged", resume)
    shutil.rmtree(cut + "-damaged")
    os.rename(cut, cut + "-moved")  # its state names the checkpoint files under the old path
    resumed = trainer.train(copy, cut + "-moved", resume)
    written = resumed.metrics.settings["output"]
    assert [entry["step"] for entry in evaluation_of(written, internal=True)["eval"]] == [4, 8, 12]


def test_a_new_training_into_an_earlier_trainings_output_path_composes_with_it(batches, tmp_path):
    _, out, _ = batches
    copy = fresh_copy(out, tmp_path)
    output = str(tmp_path / "model")
    trainer.train(copy, output, TrainOptions(noise_multiplier=1.0, bands=2))
    shutil.rmtree(output)  # the first model may have been published already: it still counts
    again = trainer.train(copy, output, TrainOptions(noise_multiplier=1.0, bands=2)).privacy
    assert again["composition"]["trainings"] == 2
    assert len({t["training"] for t in ledger(copy)}) == 2


def test_api_trainings_enter_the_ledger_at_their_first_step_and_compose(batches, tmp_path):
    import tf_keras

    from madp.training.tasks import build_model

    _, out, _ = batches
    copy = fresh_copy(out, tmp_path)
    batches_ = api.open_batches(copy)
    plan = api.calibrate(batches_, noise_multiplier=1.0, bands=2)
    assert plan.trained_on == copy

    def train(**settings):
        model, loss = build_model("logreg", 8)
        step = api.make_private(model, loss, tf_keras.optimizers.SGD(0.1), plan, **settings)
        for rows in api.read_steps(batches_, ["features", "label"]):
            step(rows["features"], rows["label"], rows["weight"], index=rows["step"])
        return step

    model, loss = build_model("logreg", 8)
    api.make_private(model, loss, tf_keras.optimizers.SGD(0.1), plan)  # made, never stepped: not a training
    seeded = train(noise_seed=1)  # not private: neither entered nor composed
    assert ledger(copy) == [] and seeded.plan.composition is None
    first = train()
    [entry] = ledger(copy)
    assert (entry["training"], entry["output"], entry["state"]) == (first.training, "Python API", "finished")
    second = train(output="sweep/2")
    assert second.plan.composition is not None and second.plan.composition.trainings == 2
    assert second.own_plan.epsilon == first.plan.epsilon < second.plan.epsilon
    assert [t["output"] for t in ledger(copy)] == ["Python API", "sweep/2"]


def test_a_second_api_training_on_secret_batches_is_refused_unless_retrain(batches, tmp_path):
    import tf_keras

    from madp.training.tasks import build_model

    directory, _, data = batches
    secret = str(tmp_path / "secret")  # Poisson batches from a fresh key: amplified DP-SGD relies on it
    batch_local(str(directory / "bounded"), data, secret, BatchOptions(steps=STEPS, batch_size=32))
    plan = api.calibrate(api.open_batches(secret), noise_multiplier=1.0)
    assert plan.relies_on_secret_sampling
    model, loss = build_model("logreg", 8)
    first = api.make_private(model, loss, tf_keras.optimizers.SGD(0.1), plan)
    next_step(first, list(api.read_steps(api.open_batches(secret), ["features", "label"])))  # one step: counts
    with pytest.raises(InputError, match="re-uses it"):
        api.make_private(model, loss, tf_keras.optimizers.SGD(0.1), plan)
    again = api.make_private(model, loss, tf_keras.optimizers.SGD(0.1), plan, retrain=True)
    assert again.plan.composition is not None and again.plan.epsilon > 2 * plan.epsilon


def test_steps_made_before_either_trains_and_a_finished_training_continued_are_refused(batches, tmp_path):
    """Two steps made on the same batches, then trained one after the other: the second's plan, composed
    when it was made, missed the first; it is refused at its first step, before anything runs. A
    training id names an interrupted entry to continue: a finished one, or one without resumed_at,
    would train more steps than its entry's plan accounts for."""
    import tf_keras

    from madp.training.tasks import build_model

    _, out, _ = batches
    copy = fresh_copy(out, tmp_path)
    batches_ = api.open_batches(copy)
    plan = api.calibrate(batches_, noise_multiplier=1.0, bands=2)
    steps = list(api.read_steps(batches_, ["features", "label"]))

    def made():
        model, loss = build_model("logreg", 8)
        return model, api.make_private(model, loss, tf_keras.optimizers.SGD(0.1), plan)

    (_, first), (model, second) = made(), made()
    assert first.plan.epsilon == second.plan.epsilon == plan.epsilon  # each made before any training
    for rows in api.read_steps(batches_, ["features", "label"]):
        first(rows["features"], rows["label"], rows["weight"], index=rows["step"])
    initial = [w.copy() for w in model.get_weights()]
    with pytest.raises(InputError, match="another private training entered the ledger .* make the step again"):
        next_step(second, steps)
    for a, b in zip(model.get_weights(), initial):
        np.testing.assert_array_equal(a, b)
    assert [t["training"] for t in ledger(copy)] == [first.training]
    third = made()[1]  # made now: it states the composition, and trains
    next_step(third, steps)
    assert third.plan.composition is not None and third.plan.composition.trainings == 2

    model, loss = build_model("logreg", 8)
    optimizer = tf_keras.optimizers.SGD(0.1)
    with pytest.raises(InputError, match="finished all its steps"):
        api.make_private(model, loss, optimizer, plan, training=first.training, resumed_at=STEPS // 2)
    at_its_end = api.make_private(model, loss, optimizer, plan, training=first.training, resumed_at=STEPS)
    last = steps[-1]  # continued at its last step, it may write what it computed, and run no step
    with pytest.raises(InputError, match=f"accounts for {STEPS} steps"):
        at_its_end(last["features"], last["label"], last["weight"], index=last["step"])
    with pytest.raises(InputError, match="pass resumed_at"):
        api.make_private(model, loss, optimizer, plan, training=third.training)
    with pytest.raises(InputError, match="not in the trainings ledger"):
        api.make_private(model, loss, optimizer, plan, training="no such training", resumed_at=1)
    continued = api.make_private(model, loss, optimizer, plan, training=third.training, resumed_at=1)
    next_step(continued, steps)  # an interrupted entry, continued after its step
    assert len(ledger(copy)) == 2


def test_an_interrupted_training_is_continued_once_from_a_step(batches, tmp_path):
    """Two continuations of one interrupted training from the same step would each run the steps after
    it, with new noise: released twice under one entry. Whether made one after the other or both
    before either trains, the second is refused before it runs; one from a later step continues."""
    import tf_keras

    from madp.training.tasks import build_model

    _, out, _ = batches
    copy = fresh_copy(out, tmp_path)
    plan = api.calibrate(api.open_batches(copy), noise_multiplier=1.0, bands=2)
    steps = list(api.read_steps(api.open_batches(copy), ["features", "label"]))

    def step(**continued):
        model, loss = build_model("logreg", 8)
        return api.make_private(model, loss, tf_keras.optimizers.SGD(0.1), plan, **continued)

    interrupted = step()
    for _ in range(3):
        next_step(interrupted, steps)
    training = interrupted.training
    from_two, again_from_two = step(training=training, resumed_at=2), step(training=training, resumed_at=2)
    next_step(from_two, steps)
    assert ledger(copy)[0]["resumable_from"] == 3
    with pytest.raises(InputError, match="continued or run past step 2 already"):
        # made before the first continuation entered: refused at its first step
        next_step(again_from_two, steps)
    assert again_from_two.steps_taken == 2
    with pytest.raises(InputError, match="continued or run past step 2 already"):
        step(training=training, resumed_at=2)
    from_three = step(training=training, resumed_at=3)
    next_step(from_three, steps)
    assert [(t["training"], t["state"], t["resumable_from"]) for t in ledger(copy)] == [(training, "started", 4)]
    with pytest.raises(InputError, match="hold the lock"):
        step(training=training, resumed_at=4, releases_from_checkpoints=True)
    with pytest.raises(InputError, match="resumed_at='4': the number of steps"):
        step(training=training, resumed_at="4")
    from_four = step(training=training, resumed_at=tf.Variable(4, dtype=tf.int64))  # optimizer.iterations
    next_step(from_four, steps)
    next_step(from_four, steps)
    from_four.checkpointed()  # a checkpoint after 6 steps: a continuation from step 5 would redo step 6
    assert ledger(copy)[0]["resumable_from"] == 6
    with pytest.raises(InputError, match="continued or run past step 5 already"):
        step(training=training, resumed_at=5)
    from_six = step(training=training, resumed_at=6)
    next_step(from_six, steps)
    with pytest.raises(InputError, match="was continued by another step .* this step did not run"):
        next_step(from_four, steps)  # still alive (a notebook's earlier cell): superseded
    assert from_four.steps_taken == 6 and from_six.steps_taken == 7
    [entry] = ledger(copy)
    with open(ledger_path(copy), "w") as edited:
        edited.write(json.dumps({**entry, "resumable_from": "3"}) + "\n")
    with pytest.raises(InputError, match="resumable_from is not a step count"):
        step(training=training, resumed_at=4)


def test_a_step_enters_the_ledger_only_under_the_selections_lock(batches, tmp_path):
    """Two processes must never both read the ledger before either enters it: a Python API step takes
    the lock of the batches' selection for its ledger entry. Held by another live process, the first
    step is refused before it runs, and so is the last (its entry, left 'started', would accept a
    continuation after the training's end); either runs when called again once the lock is free."""
    import socket
    import subprocess

    import tf_keras

    from madp.training.tasks import build_model

    _, out, _ = batches
    copy = fresh_copy(out, tmp_path)
    batches_ = api.open_batches(copy)
    plan = api.calibrate(batches_, noise_multiplier=1.0, bands=2)
    model, loss = build_model("logreg", 8)
    step = api.make_private(model, loss, tf_keras.optimizers.SGD(0.1), plan)
    other = subprocess.Popen(["sleep", "120"])
    lock = os.path.join(os.path.dirname(ledger_path(copy)), ".madp.lock")  # the selection's
    # as another training's lock says: it writes the ledger only, so readers go on meanwhile
    held = {"pid": other.pid, "host": socket.gethostname(), "command": "train elsewhere", "since": "now"}
    held["keeps_content"] = True
    try:
        with open(lock, "w") as handle:
            json.dump(held, handle)
        steps = list(api.read_steps(batches_, ["features", "label"]))
        initial = [w.copy() for w in model.get_weights()]
        with pytest.raises(InputError, match="being written by another madp process .*step 1 of this"):
            next_step(step, steps)
        for a, b in zip(model.get_weights(), initial):
            np.testing.assert_array_equal(a, b)
        assert ledger(copy) == []
        os.remove(lock)
        next_step(step, steps)
        assert [t["state"] for t in ledger(copy)] == ["started"] and not os.path.exists(lock), "the lock is let go"
        with open(lock, "w") as handle:  # another training takes the selection while this one runs
            json.dump(held, handle)
        for rows in steps[1:-1]:  # no ledger write: they run
            step(rows["features"], rows["label"], rows["weight"], index=rows["step"])
        with pytest.raises(InputError, match=f"step {STEPS} of this private training did not run"):
            # its entry would stay 'started', open to a continuation after the training's end
            next_step(step, steps)
        assert step.steps_taken == STEPS - 1 and [t["state"] for t in ledger(copy)] == ["started"]
        os.remove(lock)
        next_step(step, steps)
        assert step.steps_taken == STEPS and [t["state"] for t in ledger(copy)] == ["finished"]
    finally:
        other.kill()


def test_a_training_that_fails_before_its_first_noisy_update_is_not_entered(batches, tmp_path):
    """A model whose call cannot be traced (it reads a tensor's value, which only eager code has) fails as
    its first step is traced, before any noise or update: nothing of the data was released, so the ledger
    holds no entry and the next training composes with nothing. One noisy update enters the training."""
    import tf_keras

    from madp.training.tasks import build_model

    _, out, _ = batches
    copy = fresh_copy(out, tmp_path)
    batches_ = api.open_batches(copy)
    plan = api.calibrate(batches_, noise_multiplier=1.0, bands=2)
    first = next(iter(api.read_steps(batches_, ["features", "label"])))

    class EagerOnly(tf_keras.Model):
        def __init__(self):
            super().__init__(name="eager_only")
            self.dense = tf_keras.layers.Dense(1)

        def call(self, x, training=False):
            return self.dense(x / (float(tf.reduce_max(tf.abs(x)).numpy()) + 1.0))  # a Python number: eager only

    model = EagerOnly()
    model(first["features"])  # built, eagerly
    _, loss = build_model("logreg", 8)
    step = api.make_private(model, loss, tf_keras.optimizers.SGD(0.1), plan)
    initial = [w.copy() for w in model.get_weights()]
    with pytest.raises(Exception, match="numpy"):
        step(first["features"], first["label"], first["weight"], index=first["step"])
    assert_nothing_entered_and_the_next_training_starts_alone(step, model, initial, copy, plan, [first])


def test_a_training_whose_first_step_fails_as_it_runs_is_not_entered(batches, tmp_path):
    """A model that traces but fails as its first step runs (an Embedding of 4 ids given hundreds: an error
    of the running graph, not of its trace) was entered in the ledger as started, and the next training
    composed with it, though nothing of the data was released. The first step computes its noised
    gradient before the entry, so it fails there: no entry, no update. One that runs is entered."""
    import tf_keras

    from madp.training.tasks import build_model

    _, out, _ = batches
    copy = fresh_copy(out, tmp_path)
    batches_ = api.open_batches(copy)
    plan = api.calibrate(batches_, noise_multiplier=1.0, bands=2)
    steps = list(api.read_steps(batches_, ["features", "label"]))
    inputs = tf_keras.Input((8,))
    ids = tf_keras.layers.Lambda(lambda x: tf.cast(tf.abs(x) * 100.0, tf.int32))(inputs)
    embedded = tf_keras.layers.Flatten()(tf_keras.layers.Embedding(4, 2)(ids))
    model = tf_keras.Model(inputs, tf_keras.layers.Dense(1)(embedded))
    _, loss = build_model("logreg", 8)
    step = api.make_private(model, loss, tf_keras.optimizers.SGD(0.1), plan)
    initial = [w.copy() for w in model.get_weights()]
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"is not in \[0, 4\)"):
        next_step(step, steps)
    assert_nothing_entered_and_the_next_training_starts_alone(step, model, initial, copy, plan, steps)


def test_a_one_step_plan_enters_the_ledger_once(batches, tmp_path, monkeypatch):
    """Its first step is its last: one ledger write, 'finished', under one take of the lock, so no other
    process can come between a 'started' and a refused 'finished' and leave the entry open."""
    import tf_keras

    from madp.training.tasks import build_model

    _, out, _ = batches
    copy = fresh_copy(out, tmp_path)
    batches_ = api.open_batches(copy)
    plan = dataclasses.replace(api.calibrate(batches_, noise_multiplier=1.0, bands=2), steps=1)
    model, loss = build_model("logreg", 8)
    step = api.make_private(model, loss, tf_keras.optimizers.SGD(0.1), plan)
    states = []
    recorded = api.record_training
    monkeypatch.setattr(api, "record_training", lambda *args: states.append(args[4]) or recorded(*args))
    first = next(iter(api.read_steps(batches_, ["features", "label"])))
    step(first["features"], first["label"], first["weight"], index=first["step"])
    assert states == ["finished"] and [(t["state"], t["resumable_from"]) for t in ledger(copy)] == [("finished", 1)]
    with pytest.raises(InputError, match="accounts for 1 steps"):
        step(first["features"], first["label"], first["weight"], index=1)


# --- a training that replaces another (--replace) ------------------------------------------------


def finished_training(batches, tmp_path) -> tuple[str, TrainOptions, dict[str, bytes]]:
    """A finished training in tmp_path/train: its folder, its options and its files' bytes."""
    _, out, data = batches
    output = str(tmp_path / "train")
    options = TrainOptions(mechanism="none", eval_data=data, eval_every=4)
    trainer.train(out, output, options)
    return output, options, snapshot(output)


def test_a_replacing_training_that_stops_gives_the_earlier_one_back(batches, tmp_path, monkeypatch):
    """--replace sets the earlier training aside (OUTPUT/internal/replaced/) once its first step ran: stopped
    later without a checkpoint, it puts it back byte for byte; killed with no clean-up, even while setting it
    aside, the next training into OUTPUT puts it back first. Finished, it leaves nothing of it."""
    output, options, finished = finished_training(batches, tmp_path)
    out = batches[1]
    replacing = TrainOptions(**{**vars(options), "replace": True, "learning_rate": 0.5})
    with monkeypatch.context() as patch:
        crash_at(patch, 6)  # after the evaluation of step 4, in the new training's logs
        with pytest.raises(KeyboardInterrupt):
            trainer.train(out, output, replacing)
    assert snapshot(output) == finished

    aside = os.path.join(output, "internal", "replaced")
    with monkeypatch.context() as patch:  # killed at step 6: nothing settles the earlier training
        crash_at(patch, 6)
        patch.setattr(trainer, "settle_replaced", lambda output: None)
        with pytest.raises(KeyboardInterrupt):
            trainer.train(out, output, replacing)
    assert {name: content for name, content in snapshot(aside).items() if name != "files.json"} == finished
    with pytest.raises(InputError, match="holds the logs of an earlier training"):
        trainer.train(out, output, options)  # put back first, then refused as ever
    assert snapshot(output) == finished

    move = trainer.storage.move_below
    with monkeypatch.context() as patch:  # killed while moving the earlier training aside
        patch.setattr(trainer, "settle_replaced", lambda output: None)

        def killed_midway(source, target, relatives):
            move(source, target, relatives[:2])
            raise KeyboardInterrupt

        patch.setattr(trainer.storage, "move_below", killed_midway)
        with pytest.raises(KeyboardInterrupt):
            trainer.train(out, output, replacing)
    with pytest.raises(InputError, match="holds the logs of an earlier training"):
        trainer.train(out, output, options)
    assert snapshot(output) == finished

    trainer.train(out, output, replacing)
    assert json.load(open(os.path.join(output, "metrics.json")))["learning_rate"] == 0.5
    assert not os.path.exists(aside) and len(os.listdir(os.path.join(output, "internal", "logs"))) == 1


def test_a_replacing_training_stopped_with_a_checkpoint_keeps_the_earlier_one_until_it_finishes(
    batches, tmp_path, monkeypatch
):
    output, options, finished = finished_training(batches, tmp_path)
    out = batches[1]
    replacing = TrainOptions(**{**vars(options), "replace": True, "learning_rate": 0.5, "checkpoint_every": 4})
    with monkeypatch.context() as patch:
        crash_at(patch, 6)
        with pytest.raises(KeyboardInterrupt):
            trainer.train(out, output, replacing)
    aside = os.path.join(output, "internal", "replaced")
    assert {name: content for name, content in snapshot(aside).items() if name != "files.json"} == finished
    said = after_stop(output, out)
    assert "checkpoint of step 4" in said and f"{aside} keeps the training it replaces" in said
    with pytest.raises(InputError, match=re.escape(f"; {aside} keeps the training it replaces until it finishes")):
        trainer.train(out, output, replacing)  # a fresh run
    with pytest.raises(InputError, match=r"learning_rate 0.5 \(this run: no learning_rate\)"):
        trainer.train(
            out, output, TrainOptions(**{**vars(options), "replace": True, "checkpoint_every": 4, "resume": True})
        )
    assert {name: content for name, content in snapshot(aside).items() if name != "files.json"} == finished
    resumed = trainer.train(out, output, TrainOptions(**{**vars(replacing), "resume": True}))
    assert resumed.metrics.settings["resumed_at"] == 4 and resumed.metrics.settings["learning_rate"] == 0.5
    assert not os.path.exists(aside) and not os.path.exists(os.path.join(output, "internal", "checkpoints"))


def test_a_replacing_training_leaves_one_whole_training_whatever_stops_it(batches, tmp_path, monkeypatch):
    """A kill as a finished training deletes the one it replaced leaves the new one whole; a first checkpoint
    cut short (a full disk), which no resume can read, is removed and the earlier training put back; so is
    a training that diverges, whose checkpoint holds the model that computes no number."""
    output, options, finished = finished_training(batches, tmp_path)
    out = batches[1]
    replacing = TrainOptions(**{**vars(options), "replace": True, "learning_rate": 0.5})
    aside, checkpoints = os.path.join(output, "internal", "replaced"), os.path.join(output, "internal", "checkpoints")
    remove_tree = trainer.storage.remove_tree
    with monkeypatch.context() as patch:  # killed after deleting two files of the replaced training
        patch.setattr(trainer, "settle_replaced", lambda output: None)

        def killed_midway(directory):
            if directory != aside:
                return remove_tree(directory)
            for name in ("metrics.json", "privacy.json"):
                os.remove(os.path.join(aside, name))
            raise KeyboardInterrupt

        patch.setattr(trainer.storage, "remove_tree", killed_midway)
        with pytest.raises(KeyboardInterrupt):
            trainer.train(out, output, replacing)
    replaced = {name: content for name, content in snapshot(output).items() if not name.startswith("internal/replaced")}
    assert json.loads(replaced["metrics.json"])["learning_rate"] == 0.5
    with pytest.raises(InputError, match="holds the logs of an earlier training"):
        trainer.train(out, output, options)
    assert snapshot(output) == replaced

    with monkeypatch.context() as patch:  # killed between its privacy.json and deleting the list
        patch.setattr(trainer, "settle_replaced", lambda output: None)
        patch.setattr(trainer, "drop_replaced", lambda output: (_ for _ in ()).throw(KeyboardInterrupt))
        with pytest.raises(KeyboardInterrupt):
            trainer.train(out, output, TrainOptions(**{**vars(replacing), "learning_rate": 0.25}))
    with pytest.raises(InputError, match="holds the logs of an earlier training"):
        trainer.train(out, output, options)
    replaced = snapshot(output)
    assert json.loads(replaced["metrics.json"])["learning_rate"] == 0.25 and not os.path.exists(aside)

    finished = replaced  # the training to keep from here on

    def cut_short(self, done, *args):  # the disk fills as the first checkpoint is written
        os.makedirs(os.path.join(self.directory, f"ckpt-{done}_temp"))
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(trainer.Checkpoints, "save", cut_short)
        with pytest.raises(DiskFull):
            trainer.train(out, output, TrainOptions(**{**vars(replacing), "checkpoint_every": 4}))
    assert snapshot(output) == finished and not os.path.exists(checkpoints)

    diverging = TrainOptions(**{**vars(replacing), "learning_rate": 1e38, "checkpoint_every": 4})
    with pytest.raises(InputError, match=r"its evaluation on --eval-data at step 4 .* held this model, .*: removed"):
        trainer.train(out, output, diverging)
    assert snapshot(output) == finished and not os.path.exists(checkpoints)


def test_a_training_stopped_while_writing_its_outputs_writes_them_on_resume(batches, tmp_path, monkeypatch):
    """Its ledger entry is finished once its last step ran. Stopped before privacy.json, the last of its
    outputs, it keeps its last step's checkpoint: --resume writes them from it, running no step (nothing
    released twice), and its entry stays as it was."""
    _, out, _ = batches
    copy = fresh_copy(out, tmp_path)
    options = TrainOptions(noise_multiplier=1.0, bands=2, checkpoint_every=5)  # 12 steps: 5, 10 and the last
    output = str(tmp_path / "train")
    write = trainer.storage.write_text

    def stopped_before_privacy_json(path, text):
        if path.endswith("privacy.json"):
            raise KeyboardInterrupt
        write(path, text)

    with monkeypatch.context() as patch:
        patch.setattr(trainer.storage, "write_text", stopped_before_privacy_json)
        with pytest.raises(KeyboardInterrupt):
            trainer.train(copy, output, options)
    [entry] = ledger(copy)
    assert entry["state"] == "finished" and not os.path.exists(os.path.join(output, "privacy.json"))
    trained = weights(output)  # written before it stopped
    assert "--resume writes them from the checkpoint of its last step" in after_stop(output, copy)
    with pytest.raises(InputError, match="pass resume"):
        trainer.train(copy, output, options)
    resumed = trainer.train(copy, output, TrainOptions(**{**vars(options), "resume": True}))
    assert resumed.metrics.settings["resumed_at"] == STEPS and ledger(copy) == [entry]
    assert "composition" not in json.load(open(os.path.join(output, "privacy.json")))
    for a, b in zip(weights(output), trained):
        np.testing.assert_array_equal(a, b)
    assert not os.path.exists(os.path.join(output, "internal", "checkpoints"))
