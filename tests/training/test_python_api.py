"""The Python API of madp.training: the examples of its how-to pages run as written, and a step made by
`make_private` (or `make_non_private`) trains the same model, under the same plan, as `madp train`."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

pytest.importorskip("tensorflow")

from conftest import ROOT, write_records  # noqa: E402

import madp.training  # noqa: E402
from madp.cli import main  # noqa: E402
from madp.core.errors import InputError  # noqa: E402
from madp.core.selection import BoundOptions  # noqa: E402
from madp.engines.batch_local import run_local as batch_local  # noqa: E402
from madp.engines.batching import BatchOptions  # noqa: E402
from madp.engines.local_engine import run_local as bound_local  # noqa: E402
from madp.tools.data.synthetic import GraphSpec, generate, to_table  # noqa: E402
from madp.training import PrivacyPlan, calibrate, make_non_private, make_private, open_batches, read_steps  # noqa: E402
from madp.training.tasks import build_model  # noqa: E402

pytestmark = [pytest.mark.tf]

DOCS = os.path.join(ROOT, "docs", "how-to")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """A small demo-output/batches like `make demo`'s: 16 features, K = 3, 8-min-sep Poisson batches."""
    directory = tmp_path_factory.mktemp("python-api")
    rows = to_table(generate(GraphSpec(records=3000, graph="skewed", features=16, seed=1))).to_pylist()
    data = write_records(str(directory / "records.jsonl"), rows)
    bound_local(data, str(directory / "bounded"), BoundOptions(max_contributions=3))
    batch_local(
        str(directory / "bounded"),
        data,
        str(directory / "demo-output" / "batches"),
        BatchOptions(seed=0, steps=24, batch_size=32, min_sep=8, max_batch_size=64),
    )
    return directory


def docstring_example() -> str:
    """The indented block after the `::` of madp.training's docstring."""
    after = madp.training.__doc__.split("::\n\n", 1)[1]
    return textwrap.dedent(re.match(r"(?:(?: {4}.*)?\n)+", after).group(0))


def test_the_docstring_example_runs_as_written(demo, monkeypatch, capsys):
    """(The how-to pages' examples run in tests/docs/test_code_blocks.py.)"""
    monkeypatch.chdir(demo)
    exec(compile(docstring_example(), "docstring_example", "exec"), {"__name__": "example"})
    assert "True" in capsys.readouterr().out  # private: a fresh noise key, batches without amplification


def test_the_package_exports_the_api_and_imports_tensorflow_only_for_it():
    assert set(madp.training.__all__) <= set(dir(madp.training.api)) | {"load_tensorflow"}
    # `madp run` reads privacy plans without TensorFlow.
    check = "import sys, madp.training.plan; assert 'tensorflow' not in sys.modules"
    subprocess.run([sys.executable, "-c", check], check=True)
    with pytest.raises(AttributeError):
        madp.training.no_such_name  # noqa: B018


def test_calibrate_takes_train_options_by_name_and_refuses_a_non_private_mechanism(demo):
    batches = open_batches(str(demo / "demo-output" / "batches"))
    plan = calibrate(batches, noise_multiplier=1.5, bands=8, clip_norm=0.5)
    assert (plan.mechanism, plan.noise_multiplier, plan.clip_norm, len(plan.bands)) == ("bandmf", 1.5, 0.5, 8)
    assert PrivacyPlan.from_json(json.loads(json.dumps(plan.to_json()))) == plan
    with pytest.raises(InputError, match="make_non_private"):
        calibrate(batches, mechanism="none")


def _weights(path) -> list[np.ndarray]:
    import tf_keras

    return tf_keras.models.load_model(str(path), compile=False).get_weights()


@pytest.mark.parametrize("private", [True, False], ids=["private", "baseline"])
def test_the_api_trains_the_model_madp_train_trains(demo, private, capsys):
    """Same batches, model seed, noise seed and optimizer: the same weights bit for bit, and the step's
    plan is the privacy.json `madp train` wrote."""
    import tf_keras

    batches_dir = str(demo / "demo-output" / "batches")
    out = demo / ("cli-private" if private else "cli-baseline")
    flags = ["--epsilon", "8", "--bands", "8", "--noise-seed", "3"] if private else ["--mechanism", "none"]
    assert main(["-q", "train", batches_dir, str(out), "--seed", "0", "--learning-rate", "0.5", *flags]) == 0
    capsys.readouterr()

    batches = open_batches(batches_dir)
    tf_keras.utils.set_random_seed(0)  # what madp train does before building --model logreg
    model, loss = build_model("logreg", 16)
    optimizer = tf_keras.optimizers.SGD(0.5)
    if private:
        step = make_private(model, loss, optimizer, calibrate(batches, epsilon=8, bands=8), noise_seed=3)
    else:
        step = make_non_private(model, loss, optimizer)
    for rows in read_steps(batches, ["features", "label"]):
        step(rows["features"], rows["label"], rows["weight"], index=rows["step"])

    initial = build_model("logreg", 16)[0].get_weights()
    trained = model.get_weights()
    assert not np.array_equal(trained[0], initial[0])  # it trained
    for a, b in zip(trained, _weights(out / "model.keras")):
        np.testing.assert_array_equal(a, b)
    stated = json.load(open(out / "privacy.json"))
    if private:
        with pytest.raises(InputError, match="accounts for 24 steps of these batches; step 25 would release"):
            step(rows["features"], rows["label"], rows["weight"], index=24)  # a step the guarantee does not cover
        assert json.loads(json.dumps(step.plan.to_json())) == stated
        assert stated["private"] is False and stated["noise"] == "fixed seed - not private"
    else:
        assert stated == {"mechanism": "none", "private": False}


def test_steps_dataset_gives_read_steps_rows_as_a_tf_data_pipeline_and_trains_the_same_model(demo):
    import tf_keras

    batches = open_batches(str(demo / "demo-output" / "batches"))
    dataset = madp.training.steps_dataset(batches, ["features", "label"])
    arrays = list(read_steps(batches, ["features", "label"]))
    tensors = list(dataset)
    assert len(tensors) == len(arrays) == batches.steps
    for index, (rows, step_rows) in enumerate(zip(arrays, tensors)):
        assert set(rows) == set(step_rows) == {"features", "label", "weight", "step"}  # the rows' step: no number
        assert set(rows["step"]) == {index}
        for name in rows:
            np.testing.assert_array_equal(step_rows[name].numpy(), rows[name])
            assert step_rows[name].dtype.as_numpy_dtype == rows[name].dtype
    plan = calibrate(batches, epsilon=8, bands=8)
    trained = []
    for steps in (arrays, tensors):
        tf_keras.utils.set_random_seed(0)
        model, loss = build_model("logreg", 16)
        step = make_private(model, loss, tf_keras.optimizers.SGD(0.5), plan, noise_seed=3)
        for rows in steps:
            step(rows["features"], rows["label"], rows["weight"], index=rows["step"])
        trained.append(model.get_weights())
    for a, b in zip(*trained):
        np.testing.assert_array_equal(a, b)
    # a step's rows again, or out of order: refused before it runs
    step = make_private(build_model("logreg", 16)[0], loss, tf_keras.optimizers.SGD(0.5), plan, noise_seed=3)
    first, second = tensors[:2]
    step(first["features"], first["label"], first["weight"], index=first["step"])
    for rows in (first, tensors[2]):
        with pytest.raises(InputError, match=r"rows of step \d+ where step 1 is next"):
            step(rows["features"], rows["label"], rows["weight"], index=rows["step"])
    step(second["features"], second["label"], second["weight"], index=second["step"])


def private_dense(K, plan: PrivacyPlan, inputs: int, **settings):
    """(model, step): a one-unit Dense model of Keras `K` (tf_keras or keras), seeded, and its private
    step under `plan` (sigmoid cross-entropy, SGD at 0.5, noise seed 3, `settings` for make_private): two
    of them, one trained from a loop and one by fit, must end equal."""
    tf = madp.training.load_tensorflow()

    def loss(labels, logits):
        labels = tf.cast(labels[:, None], tf.float32)
        return tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits)[:, 0]

    K.utils.set_random_seed(0)
    model = K.Sequential([K.Input((inputs,)), K.layers.Dense(1)])
    return model, make_private(model, loss, K.optimizers.SGD(0.5), plan, noise_seed=3, **settings)


@pytest.mark.parametrize("flavour", ["tf_keras", "keras"])
def test_fit_trains_with_the_private_step_as_the_loop_does(demo, flavour):
    """`model.fit` with the step as the model's train_step gives the loop's model bit for bit; an epoch
    past the plan's steps and a traced (not eager) fit are refused."""
    import importlib

    K = importlib.import_module(flavour)
    batches = open_batches(str(demo / "demo-output" / "batches"))
    plan = calibrate(batches, epsilon=8, bands=8)

    looped, step = private_dense(K, plan, inputs=16)
    for rows in read_steps(batches, ["features", "label"]):
        step(rows["features"], rows["label"], rows["weight"], index=rows["step"])
    fitted, step = private_dense(K, plan, inputs=16)
    fitted.train_step = step.keras_train_step
    fitted.compile(run_eagerly=True)
    steps = madp.training.steps_dataset(batches, ["features", "label"])
    elements = steps.map(lambda r: (r["features"], r["label"], r["weight"], r["step"]))
    history = fitted.fit(elements, verbose=0)
    assert history.history["iterations"] == [batches.steps]
    for a, b in zip(looped.get_weights(), fitted.get_weights()):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(InputError, match="the plan accounts for 24 steps of these batches; step 25 would release"):
        fitted.fit(elements, verbose=0)  # a second epoch
    repeated, step = private_dense(K, plan, inputs=16)  # an element twice within the plan's T calls: refused
    repeated.train_step = step.keras_train_step
    repeated.compile(run_eagerly=True)
    with pytest.raises(InputError, match="rows of step 0 where step 1 is next"):
        repeated.fit(elements.take(1).repeat(2), verbose=0)
    with pytest.raises(InputError, match=r"\(x, y, weight, index\)"):  # no index
        repeated.fit(steps.map(lambda r: (r["features"], r["label"], r["weight"])), verbose=0)
    counted, step = private_dense(K, plan, inputs=16)  # shuffled, each element named by enumerate's number
    counted.train_step = step.keras_train_step
    counted.compile(run_eagerly=True)
    with pytest.raises(InputError, match="index=0 is a number, which says nothing of the rows"):
        counted.fit(
            steps.shuffle(64, seed=1).enumerate().map(lambda i, r: (r["features"], r["label"], r["weight"], i)),
            verbose=0,
        )
    assert step.steps_taken == 0
    traced, step = private_dense(K, plan, inputs=16)
    traced.train_step = step.keras_train_step
    traced.compile(run_eagerly=False)
    with pytest.raises(Exception, match="run_eagerly=True"):  # tf_keras wraps it in its StagingError
        traced.fit(elements, verbose=0)


def test_a_private_step_takes_all_the_rows_of_its_next_step_named_by_their_own_step(demo):
    """The loop form names each call's step by its rows (`index`: the rows' own `step`, one entry per row),
    so what ordinary tf.data use does to the steps is refused before any update: shuffled steps, named by
    their rows' step or by `enumerate`'s number; rows unbatched and batched again; a step's rows twice; a
    part of a step (its padding rows left out); its padding rows replaced by copies of its records; and a
    call that names no step. Only all the rows of the
    next step, padding rows (which carry their step) included, run."""
    import tf_keras

    batches = open_batches(str(demo / "demo-output" / "batches"))
    plan = calibrate(batches, epsilon=8, bands=8)
    model, loss = build_model("logreg", 16)
    step = make_private(model, loss, tf_keras.optimizers.SGD(0.5), plan, noise_seed=3)
    initial = [w.copy() for w in model.get_weights()]
    steps = madp.training.steps_dataset(batches, ["features", "label"])
    first = next(iter(read_steps(batches, ["features", "label"])))
    assert len(first["weight"]) == batches.max_rows_per_step == 64 and set(first["step"]) == {0}
    assert 0 < first["weight"].sum() < 64  # padded to B_max: the padding rows carry their step too

    def call(rows, index):
        step(rows["features"], rows["label"], rows["weight"], index=index)

    with pytest.raises(InputError, match=r"needs the rows' own step: .*index=rows\['step'\]"):
        step(first["features"], first["label"], first["weight"])
    shuffled = list(steps.shuffle(64, seed=1))
    assert [int(rows["step"][0]) for rows in shuffled] != list(range(batches.steps))
    with pytest.raises(InputError, match=r"rows of step \d+ where step 0 is next"):
        for rows in shuffled:
            call(rows, rows["step"])
    for number in (0, np.int64(0), next(iter(steps))["step"][0]):  # enumerate's, a numpy number, a scalar tensor
        with pytest.raises(InputError, match=r"index=0 is a number, which says nothing of the rows"):
            call(shuffled[0], number)
    rebatched = list(steps.unbatch().batch(100))
    with pytest.raises(InputError, match="rows of steps 0 to 1 in one call where step 0 is next"):
        call(rebatched[0], rebatched[0]["step"])
    with pytest.raises(InputError, match="index=0 is a number"):
        call(rebatched[0], 0)
    twice = {name: np.concatenate([first[name], first[name]]) for name in first}
    with pytest.raises(InputError, match="128 rows where step 0 holds 64: each call takes all the rows of one step"):
        call(twice, twice["step"])
    real = int(first["weight"].sum())
    without_padding = {name: values[:real] for name, values in first.items()}
    with pytest.raises(InputError, match=f"{real} rows where step 0 holds 64"):
        call(without_padding, without_padding["step"])
    records = np.flatnonzero(first["weight"])
    copies = np.concatenate([records, records[np.arange(64 - real) % real]])  # padding rows given records' copies
    filled = {name: values[copies] for name, values in first.items()}
    with pytest.raises(InputError, match=f"64 rows of non-zero weight where step 0 holds {real} records"):
        call(filled, filled["step"])
    with pytest.raises(InputError, match="index holds 2 entries for 64 rows"):
        call(first, first["step"][:2])
    assert step.steps_taken == 0
    for a, b in zip(model.get_weights(), initial):
        np.testing.assert_array_equal(a, b)
    for rows in steps:  # each element whole, in order: every step runs
        call(rows, rows["step"])
    assert step.steps_taken == batches.steps


@pytest.fixture(scope="module")
def unpadded(demo):
    """Batches of the demo's selection without padding (no --max-batch-size), at two rows per step on
    average: steps of the sizes their sampling drew, some empty."""
    batches = demo / "unpadded"
    options = BatchOptions(seed=0, steps=30, batch_size=2)
    batch_local(str(demo / "bounded"), str(demo / "records.jsonl"), str(batches), options)
    return batches


def test_on_unpadded_batches_each_call_takes_exactly_the_rows_its_step_holds(unpadded, tmp_path):
    """Unpadded, a step holds the rows its sampling drew, which the batch report records per step
    (`written_batch_sizes`): a step padded up to the largest with its own rows (a row twice), or given
    without some of its rows, is refused, and an empty `step` is taken only where the step holds no rows.
    Batches whose report does not record them (madp before it did): the rows are counted in the files."""
    import tf_keras

    steps = list(read_steps(open_batches(str(unpadded)), ["features", "label"]))
    sizes = [len(rows["step"]) for rows in steps]
    largest = max(sizes)
    assert json.load(open(unpadded / "report.json"))["written_batch_sizes"]["per_step"] == sizes
    assert 0 in sizes and len(set(sizes)) > 2
    earlier = tmp_path / "earlier-madp"
    shutil.copytree(unpadded, earlier)
    report = json.load(open(earlier / "report.json"))
    del report["written_batch_sizes"]["per_step"]
    (earlier / "report.json").write_text(json.dumps(report))
    for directory in (unpadded, earlier):
        batches = open_batches(str(directory))
        model, loss = build_model("logreg", 16)
        plan = calibrate(batches, noise_multiplier=1.0)  # calibrating to an epsilon would take a minute here
        step = make_private(model, loss, tf_keras.optimizers.SGD(0.5), plan, noise_seed=3)

        def call(rows, picked, step=step):
            step(rows["features"][picked], rows["label"][picked], rows["weight"][picked], index=rows["step"][picked])

        for index, rows in enumerate(steps):
            held = len(rows["step"])
            own_rows_again = np.concatenate([np.arange(held), np.arange(min(held, largest - held))])
            if len(own_rows_again) > held:  # padded up to the largest step with its own rows: the review's case
                with pytest.raises(InputError, match=f"{len(own_rows_again)} rows where step {index} holds {held}:"):
                    call(rows, own_rows_again)
            if held:
                with pytest.raises(InputError, match=f"0 rows where step {index} holds {held}:"):
                    call(rows, np.arange(0))  # an empty step given for one that holds rows
            call(rows, np.arange(held))  # all its rows; an empty step, where it holds none
        assert step.steps_taken == batches.steps


@pytest.mark.parametrize("flavour", ["tf_keras", "keras"])
def test_fit_refuses_callbacks_that_choose_the_model_by_private_validation_data(demo, flavour, tmp_path):
    """fit measures `validation_data` without noise: EarlyStopping (restoring the best weights) or
    ReduceLROnPlateau would choose the released model, or its training, by a statistic of those records.
    Refused before the first step unless the caller says the validation data is public; recording
    callbacks, and validation without callbacks, are not refused."""
    import importlib

    K = importlib.import_module(flavour)
    batches = open_batches(str(demo / "demo-output" / "batches"))
    plan = calibrate(batches, epsilon=8, bands=8)
    elements = madp.training.steps_dataset(batches, ["features", "label"]).map(
        lambda r: (r["features"], r["label"], r["weight"], r["step"])
    )
    held = next(iter(read_steps(batches, ["features", "label"])))  # records of the batches: private
    validation = (held["features"], held["label"][:, None].astype(np.float32))

    def model_and_step(**settings):
        model, step = private_dense(K, plan, inputs=16, **settings)
        model.train_step = step.keras_train_step
        model.compile(run_eagerly=True, loss=K.losses.BinaryCrossentropy(from_logits=True))
        return model, step

    for callback, named in (
        (K.callbacks.EarlyStopping(monitor="val_loss", patience=0, restore_best_weights=True), "EarlyStopping"),
        (K.callbacks.ReduceLROnPlateau(monitor="val_loss"), "ReduceLROnPlateau"),
        (K.callbacks.ModelCheckpoint(str(tmp_path / "best.keras"), save_best_only=True), "ModelCheckpoint"),
    ):
        model, step = model_and_step()
        initial = [w.copy() for w in model.get_weights()]
        with pytest.raises(InputError, match=f"validation_data and the callbacks {named}: .*validation_data_public"):
            model.fit(elements, validation_data=validation, callbacks=[callback], verbose=0)
        assert step.steps_taken == 0 and all(np.array_equal(a, b) for a, b in zip(model.get_weights(), initial))
    early = K.callbacks.EarlyStopping(monitor="val_loss", restore_best_weights=True)
    for callbacks, settings in (([early], {"validation_data_public": True}), ([K.callbacks.History()], {}), (None, {})):
        model, step = model_and_step(**settings)
        model.fit(elements, validation_data=validation, callbacks=callbacks, verbose=0)
        assert step.steps_taken == batches.steps


def test_fit_trains_user_sampled_batches_with_each_rows_user_as_the_loop_does(tmp_path):
    """On user-level batches (`--sampler users`: a sampled user brings all its records, clipped
    together), fit's elements (x, y, weight, users, index) give the loop's model bit for bit, and a
    step without the rows' users is refused."""
    import tf_keras as K

    rng = np.random.default_rng(6)
    rows = [{"id": i, "users": [i % 40], "features": rng.normal(size=4).tolist(), "label": i % 2} for i in range(240)]
    data = write_records(str(tmp_path / "single.jsonl"), rows)
    bound_local(data, str(tmp_path / "bounded"), BoundOptions(max_contributions=4))
    options = BatchOptions(seed=0, steps=12, batch_size=6, sampler="users")
    batch_local(str(tmp_path / "bounded"), data, str(tmp_path / "batches"), options)
    batches = open_batches(str(tmp_path / "batches"))
    plan = calibrate(batches, epsilon=8)
    assert plan.mechanism == "dpsgd-uls"

    looped, step = private_dense(K, plan, inputs=4)
    for rows_of_step in read_steps(batches, ["features", "label", "user"]):
        x, y, weight = rows_of_step["features"], rows_of_step["label"], rows_of_step["weight"]
        step(x, y, weight, users=rows_of_step["user"], index=rows_of_step["step"])
    fitted, step = private_dense(K, plan, inputs=4)
    fitted.train_step = step.keras_train_step
    fitted.compile(run_eagerly=True)
    steps = madp.training.steps_dataset(batches, ["features", "label", "user"])
    fitted.fit(steps.map(lambda r: (r["features"], r["label"], r["weight"], r["user"], r["step"])), verbose=0)
    for a, b in zip(looped.get_weights(), fitted.get_weights()):
        np.testing.assert_array_equal(a, b)
    unknown, step = private_dense(K, plan, inputs=4)
    unknown.train_step = step.keras_train_step
    unknown.compile(run_eagerly=True)
    with pytest.raises(InputError, match="user-level steps need each row's user"):
        unknown.fit(steps.map(lambda r: (r["features"], r["label"], r["weight"], r["step"])), verbose=0)


def test_a_dense_model_built_under_mixed_precision_is_told_its_private_steps_compute_in_float32(demo, caplog):
    """A Dense stack's clipping runs its layers on their float32 weights, so the bfloat16 policy changes
    nothing in its private steps: the step says so rather than let --mixed-precision seem to apply."""
    import logging

    import tf_keras

    from madp.training.text import text_classifier

    batches = open_batches(str(demo / "demo-output" / "batches"))
    plan = calibrate(batches, epsilon=8, bands=8)
    builds = {
        "logreg": lambda: build_model("logreg", 16),
        "bag": lambda: text_classifier(32, 8, 24, 3),  # its EmbeddingBag computes in bfloat16 when clipping
    }
    for name, mixed in (("logreg", True), ("logreg", False), ("bag", True)):
        caplog.clear()
        with madp.training.compute_precision(mixed):
            model, loss = builds[name]()
        with caplog.at_level(logging.WARNING, logger="madp.train"):
            make_private(model, loss, tf_keras.optimizers.SGD(0.5), plan, noise_seed=3)
        said = "its private steps compute in float32" in caplog.text
        assert said == (name == "logreg" and mixed), (name, mixed, caplog.text)


def test_a_model_xla_cannot_compile_is_refused_under_xla_before_the_training_enters_the_ledger(demo):
    """An op XLA has no kernel for (a numpy_function here): the step is lowered before the first step, so
    the refusal is a clear error naming the op, and neither a private training (fresh noise key, so it
    would enter the trainings ledger) nor the baseline has trained or been entered."""
    import tensorflow as tf
    import tf_keras

    from madp.training.ledger import earlier_trainings, ledger_of

    batches_dir = str(demo / "demo-output" / "batches")
    batches = open_batches(batches_dir)
    plan = calibrate(batches, epsilon=8, bands=8)
    rows = next(iter(read_steps(batches, ["features", "label"])))
    _, loss = build_model("logreg", 16)

    def model_with_a_python_op():
        inputs = tf_keras.Input((16,))
        copied = tf_keras.layers.Lambda(
            lambda t: tf.ensure_shape(tf.numpy_function(lambda a: a, [t], tf.float32, stateful=False), [None, 16])
        )(inputs)
        return tf_keras.Model(inputs, tf_keras.layers.Dense(1, activation="sigmoid")(copied), name="python_op")

    ledger_before = earlier_trainings(ledger_of(batches_dir))
    xla = {"jit_compile": True, "rows_per_replica": batches.max_rows_per_step}
    for make in (
        lambda model: make_private(model, loss, tf_keras.optimizers.SGD(0.5), plan, **xla),
        lambda model: make_non_private(model, loss, tf_keras.optimizers.SGD(0.5), **xla),
    ):
        model = model_with_a_python_op()
        initial = [w.copy() for w in model.get_weights()]
        step = make(model)
        with pytest.raises(InputError, match=r"XLA cannot compile the steps of model python_op: .*PyFunc"):
            step(rows["features"], rows["label"], rows["weight"], index=rows["step"])
        if hasattr(step, "privatized_gradient"):  # the API's other way to take a private step
            with pytest.raises(InputError, match=r"XLA cannot compile the steps of model python_op"):
                step.privatized_gradient(rows["features"], rows["label"], rows["weight"], index=rows["step"])
        for a, b in zip(model.get_weights(), initial):
            np.testing.assert_array_equal(a, b)
        assert earlier_trainings(ledger_of(batches_dir)) == ledger_before


def test_the_command_line_trainer_uses_only_the_public_api():
    """`madp train` imports from madp.training only the package's exported names and the trainer's own
    parts (its tasks, the user's tasks and the rows a task cannot use, pretrained models, options, outputs,
    long jobs, and what it checks and builds before the first step): the plan, the batches and the private
    step reach it through the API a user has."""
    import ast

    parts = ("tasks", "user_tasks", "task_rows", "pretrained", "options", "outputs", "long_training", "preparation")
    own = {f"madp.training.{name}" for name in parts}
    found = {}
    for module in ("trainer.py", "preparation.py"):  # the loop, and what it checks and builds before it
        source = open(os.path.join(ROOT, "tf_training", module), encoding="utf-8").read()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("madp.training"):
                found.setdefault(node.module, set()).update(alias.name for alias in node.names)
            elif isinstance(node, ast.Import):
                assert not any(alias.name.startswith("madp.training") for alias in node.names)
    assert found["madp.training"] <= set(madp.training.__all__), found["madp.training"] - set(madp.training.__all__)
    assert set(found) - {"madp.training"} <= own, set(found) - {"madp.training"} - own
    assert {"calibrate", "make_private", "make_non_private", "read_steps"} <= found["madp.training"]
