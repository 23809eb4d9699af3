"""`--model module:function` models: `function(schema)` builds a tf_keras or a Keras 3 model for the
batches' features (several inputs, a multi-class label), which trains privately through `madp train`
and through `make_private`, and is evaluated for its task (not as a binary classifier)."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest

pytest.importorskip("tensorflow")

from conftest import write_records  # noqa: E402

from madp.accounting.calibrate import epsilon  # noqa: E402
from madp.accounting.mechanisms import DpSgd  # noqa: E402
from madp.cli import main  # noqa: E402
from madp.core.errors import InputError  # noqa: E402
from madp.core.randomness import SecretKey  # noqa: E402
from madp.core.selection import BoundOptions  # noqa: E402
from madp.engines.batch_local import run_local as batch_local  # noqa: E402
from madp.engines.batching import BatchOptions  # noqa: E402
from madp.engines.local_engine import run_local as bound_local  # noqa: E402
from madp.training import calibrate, make_private, open_batches, read_steps  # noqa: E402
from madp.training.outputs import evaluation_of  # noqa: E402
from madp.training.queries import DpSgdQuery  # noqa: E402
from madp.training.user_tasks import Feature, ModelSchema, user_model  # noqa: E402

pytestmark = [pytest.mark.tf]

# A Keras 3 classifier of one 4-wide input into 4 classes (its own optimizer: --optimizer's).
KERAS3_MODULE = """
import keras


def build(schema):
    (feature,) = schema.inputs
    model = keras.Sequential(
        [keras.Input(shape=feature.shape), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(schema.classes)]
    )

    def loss(labels, logits):  # one loss per row
        return keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)

    return model, loss
"""

# A tf_keras binary classifier of two inputs, by feature name, with its own optimizer.
TWO_INPUTS_MODULE = """
import tensorflow as tf
import tf_keras


def build(schema):
    inputs = {f.name: tf_keras.Input(shape=f.shape, name=f.name) for f in schema.inputs}
    hidden = tf_keras.layers.Dense(8, activation="relu")(tf_keras.layers.Concatenate()(list(inputs.values())))
    model = tf_keras.Model(inputs, tf_keras.layers.Dense(1)(hidden))

    def loss(labels, logits):
        labels = tf.cast(tf.reshape(labels, [-1]), tf.float32)
        return tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=tf.reshape(logits, [-1]))

    return model, loss, tf_keras.optimizers.SGD(0.5)
"""

# A task of one's own: the class of input a, its rows centred first (a preprocessing hook), evaluated
# by top-1 and top-2 accuracy; a negative class is a row it cannot use.
TOP_K_TASK = """
import numpy as np


class TopK:
    features = ["a", "cls"]

    def encode(self, rows):
        a = np.asarray(rows["a"], np.float32)
        return a - a.mean(axis=1, keepdims=True), np.asarray(rows["cls"]).astype(np.int32)

    def metrics(self, labels, outputs):
        ranked = np.argsort(-outputs, axis=1)
        return {
            "top1": float(np.mean(ranked[:, 0] == labels)),
            "top2": float(np.mean((ranked[:, :2] == labels[:, None]).any(axis=1))),
        }

    def problems(self, rows):
        return np.where(np.asarray(rows["cls"]) < 0, "negative class", "")


def task(features):
    assert features["a"].shape == (4,) and features["cls"].dtype == "int64"
    return TopK()


def no_metrics(features):
    return type("Half", (), {"features": ["a", "cls"], "encode": lambda self, rows: (rows["a"], rows["cls"])})()


class Standardized(TopK):  # each input scaled by the step's statistics: one record moves every row
    def encode(self, rows):
        a = np.asarray(rows["a"], np.float32)
        return (a - a.mean(axis=0)) / (a.std(axis=0) + 1e-6), np.asarray(rows["cls"]).astype(np.int32)


def standardized(features):
    return Standardized()
"""

# Its model: the ModelSchema of the task's features (a as the input, cls as the label).
FOUR_CLASSES_MODULE = """
import tensorflow as tf
import tf_keras


def build(schema):
    (a,) = schema.inputs
    assert schema.label.name == "cls" and schema.task.startswith("top_k:")
    model = tf_keras.Sequential([tf_keras.Input(shape=a.shape), tf_keras.layers.Dense(4)])

    def loss(labels, logits):
        return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=tf.cast(labels, tf.int32), logits=logits)

    return model, loss
"""


# User code that goes wrong: models and tasks that raise, return the wrong thing, or NaN.
HOSTILE_MODULE = """
import numpy as np
import tensorflow as tf
import tf_keras


def build(schema):  # a 4-class model of input a
    model = tf_keras.Sequential([tf_keras.Input(shape=schema.inputs[0].shape), tf_keras.layers.Dense(4)])

    def loss(labels, logits):
        return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=tf.cast(labels, tf.int32), logits=logits)

    return model, loss


def raising(schema):
    raise RuntimeError("no layer for this schema")


def not_a_model(schema):
    return "a model", lambda labels, outputs: outputs


def not_an_optimizer(schema):
    return (*build(schema), "adam")


def nan_weights(schema):
    model, loss = build(schema)
    model.layers[-1].bias.assign(np.full(4, np.nan, np.float32))
    return model, loss


def nan_loss(schema):
    model, loss = build(schema)
    return model, lambda labels, logits: loss(labels, logits) * np.nan


def loss_raising(schema):
    model, _ = build(schema)

    def loss(labels, logits):
        raise ValueError("labels of the wrong rank")

    return model, loss


def loss_raising_when_traced(schema):  # works eagerly, fails as the step is traced
    model, loss = build(schema)

    def traced_only(labels, logits):
        if not tf.executing_eagerly():
            raise ValueError("labels of the wrong rank")
        return loss(labels, logits)

    return model, traced_only


def nan_when_trained(schema):  # a finite loss before the first step, NaN on the trained model
    model, loss = build(schema)
    eager_calls = []

    def checked(labels, logits):
        if tf.executing_eagerly():  # madp's checks outside the steps: before the first, after the last
            eager_calls.append(1)
        return loss(labels, logits) * (np.nan if len(eager_calls) > 1 else 1.0)

    return model, checked


class Task:
    features = ["a", "cls"]

    def encode(self, rows):
        return np.asarray(rows["a"], np.float32), np.asarray(rows["cls"]).astype(np.int32)

    def metrics(self, labels, outputs):
        return {"accuracy": float(np.mean(outputs.argmax(axis=1) == labels))}


def task(features):
    return Task()


def task_raising(features):
    raise KeyError("cls")


def encode_raising(features):
    class EncodeRaising(Task):
        def encode(self, rows):
            raise ValueError("no such column")

    return EncodeRaising()


def encode_one_array(features):
    class OneArray(Task):
        def encode(self, rows):
            return np.asarray(rows["a"], np.float32)

    return OneArray()


def encode_too_few_labels(features):
    class TooFew(Task):
        def encode(self, rows):
            x, y = super().encode(rows)
            return x, y[:1]

    return TooFew()


def encode_nan(features):  # the log of a feature that is negative in about half the rows
    class NanFeatures(Task):
        def encode(self, rows):
            x, y = super().encode(rows)
            with np.errstate(invalid="ignore"):
                return np.log(x), y

    return NanFeatures()


def metrics_raising(features):
    class MetricsRaising(Task):
        def metrics(self, labels, outputs):
            raise ZeroDivisionError("division by zero")

    return MetricsRaising()


def metrics_text(features):
    class MetricsText(Task):
        def metrics(self, labels, outputs):
            return {"accuracy": "high"}

    return MetricsText()


def metrics_nan(features):
    class MetricsNan(Task):
        def metrics(self, labels, outputs):
            return {"accuracy": float("nan")}

    return MetricsNan()


def metrics_raising_later(features):  # fine on the untrained model, raises on the trained one
    class Later(Task):
        calls = 0

        def metrics(self, labels, outputs):
            self.calls += 1
            if self.calls > 1:
                raise IndexError("list index out of range")
            return super().metrics(labels, outputs)

    return Later()
"""


def _rows(count: int, seed: int) -> list[dict]:
    """Records of 2000 users: inputs a (4 floats) and b (3 floats), a class (the largest of a) and a
    binary label (whether a and b sum above 0)."""
    rng = np.random.default_rng(seed)
    a, b = rng.normal(size=(count, 4)), rng.normal(size=(count, 3))
    return [
        {
            "id": i,
            "users": [int(i % 2000)],
            "a": a[i].round(4).tolist(),
            "b": b[i].round(4).tolist(),
            "cls": int(a[i].argmax()),
            "label": int(a[i].sum() + b[i].sum() > 0),
        }
        for i in range(count)
    ]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    directory = tmp_path_factory.mktemp("user-models")
    records = write_records(str(directory / "records.jsonl"), _rows(4000, 0))
    write_records(str(directory / "test.jsonl"), _rows(600, 1))
    bound_local(records, str(directory / "bounded"), BoundOptions(max_contributions=2))
    options = BatchOptions(seed=0, steps=40, batch_size=128)
    batch_local(str(directory / "bounded"), records, str(directory / "batches"), options)
    modules = directory / "models"
    modules.mkdir()
    (modules / "k3_classifier.py").write_text(textwrap.dedent(KERAS3_MODULE))
    (modules / "two_inputs.py").write_text(textwrap.dedent(TWO_INPUTS_MODULE))
    (modules / "top_k.py").write_text(textwrap.dedent(TOP_K_TASK))
    (modules / "four_classes.py").write_text(textwrap.dedent(FOUR_CLASSES_MODULE))
    (modules / "hostile.py").write_text(HOSTILE_MODULE)
    return directory


# Trainings at a given sigma: one PLD of DP-SGD's mixture for every test of this module (calibrating to an
# epsilon, which none of them tests, evaluates about 17 sigmas: most of each test's time)
SIGMA = ["--noise-multiplier", "1"]

CASES = {
    "keras3-multiclass": (
        "k3_classifier:build",
        ["--inputs", "a", "--label", "cls", "--task", "multiclass", "--classes", "4"],
    ),
    "tf_keras-two-inputs": ("two_inputs:build", ["--inputs", "a,b", "--label", "label"]),
}


@pytest.mark.parametrize("case", CASES)
def test_madp_train_trains_a_module_model_privately_and_evaluates_its_task(data, case, capsys, caplog):
    model, flags = CASES[case]
    out = data / case
    argv = ["-q", "train", str(data / "batches"), str(out), "--model", model, "--model-path", str(data / "models")]
    argv += [*SIGMA, "--eval-data", str(data / "test.jsonl"), "--eval-every", "20", *flags]
    assert main(argv) == 0, capsys.readouterr().err
    metrics = evaluation_of(str(out), internal=True)  # test.jsonl is not declared public
    privacy = json.load(open(out / "privacy.json"))
    assert privacy["mechanism"] == "dpsgd"  # (batches of a fixed seed: not private)
    stated = (privacy["noise_multiplier"], privacy["epsilon"])  # the accountant's epsilon at the sigma trained at
    assert stated == (1, epsilon(DpSgd(**privacy["parameters"]), 1.0, privacy["delta"]))
    assert [m["step"] for m in metrics["eval"]] == [20, 40]
    final = metrics["final"]
    assert set(final) == {"step", "loss", "accuracy"} and np.isfinite(final["loss"])
    assert final["accuracy"] > (0.45 if case.startswith("keras3") else 0.7)  # chance: 0.25 and about 0.5
    assert (out / "model.keras").exists()
    used = json.load(open(out / "metrics.json"))  # the optimizer that trained: the model's own, else madp's
    own = case.startswith("tf_keras")  # two_inputs:build returns SGD(0.5); k3_classifier:build none
    assert (used["optimizer"], used.get("learning_rate")) == (("SGD (the model's own)", None) if own else ("sgd", 0.5))
    assert "per-example gradients" not in caplog.text  # Dense layers of either Keras: the fast clipping path


@pytest.mark.parametrize("jit_compile", [False, True], ids=["plain", "xla"])
def test_make_private_trains_a_keras3_model_on_two_inputs(data, jit_compile):
    """Also compiled by XLA (per-example gradients inside the program, steps padded to B_max)."""
    import keras

    batches = open_batches(str(data / "batches"))
    features = batches.schema.features
    schema = ModelSchema(
        tuple(Feature(name, "float", features[name].shape) for name in ("a", "b")),
        Feature("cls", "int64", ()),
        "multiclass",
        classes=4,
    )
    inputs = {f.name: keras.Input(shape=f.shape, name=f.name) for f in schema.inputs}
    model = keras.Model(inputs, keras.layers.Dense(4)(keras.layers.Concatenate()([inputs["a"], inputs["b"]])))

    def loss(labels, logits):
        return keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)

    initial = [w.copy() for w in model.get_weights()]
    padded = batches.max_rows_per_step if jit_compile else None
    step = make_private(
        model, loss, keras.optimizers.SGD(0.5), calibrate(batches, noise_multiplier=1.0), jit_compile=jit_compile,
        rows_per_replica=padded,
    )  # fmt: skip
    for rows in read_steps(batches, ["a", "b", "cls"]):
        step({"a": rows["a"], "b": rows["b"]}, rows["cls"].astype(np.int32), rows["weight"], index=rows["step"])
    assert not np.array_equal(model.get_weights()[0], initial[0])
    if jit_compile:  # the step that trained is one XLA program
        from madp.training.steps import split_over_replicas

        args = split_over_replicas(step.strategy, {"a": rows["a"], "b": rows["b"]}, rows["cls"].astype(np.int32),
                                   rows["weight"], None, padded)  # fmt: skip
        assert "HloModule" in step._replica_step.experimental_get_compiler_ir(*args)(stage="hlo")
    test = _rows(600, 1)
    x = {name: np.array([r[name] for r in test], np.float32) for name in ("a", "b")}
    accuracy = np.mean(np.asarray(model(x)).argmax(axis=1) == np.array([r["cls"] for r in test]))
    assert accuracy > 0.45 and step.plan.mechanism == "dpsgd"

    # The wrong Keras's optimizer is refused by name, not with an AttributeError deep in TensorFlow.
    import tf_keras

    with pytest.raises(InputError, match="Keras 3 model.*keras.optimizers"):
        make_private(model, loss, tf_keras.optimizers.SGD(0.5), calibrate(batches, noise_multiplier=1.0))


def test_a_module_that_cannot_be_imported_is_a_clear_error(data, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["-q", "train", str(data / "batches"), str(tmp_path / "out"), "--epsilon", "8", "--inputs", "a,b"]
    assert main([*argv, "--model", "no_such_module:build"]) == 2
    err = capsys.readouterr().err
    assert "cannot import module 'no_such_module'" in err and str(tmp_path) in err and "Traceback" not in err
    (tmp_path / "broken_model.py").write_text("raise RuntimeError('no GPU here')\n")  # found in the current dir
    assert main([*argv, "--model", "broken_model:build"]) == 2
    assert "importing module 'broken_model' failed: RuntimeError: no GPU here" in capsys.readouterr().err
    assert main([*argv, "--model", "two_inputs:nope", "--model-path", str(data / "models")]) == 2
    assert "has no 'nope'" in capsys.readouterr().err
    own_optimizer = [*argv, "--model", "two_inputs:build", "--model-path", str(data / "models")]
    assert main([*own_optimizer, "--label", "label", "--optimizer", "adam", "--adam-epsilon", "1e-3"]) == 2
    assert "--optimizer, --adam-epsilon: this model brings its own optimizer" in capsys.readouterr().err
    assert main([*own_optimizer, "--label", "label", "--learning-rate", "0.1", "--lr-schedule", "cosine"]) == 2
    assert "--learning-rate, --lr-schedule: this model brings its own optimizer" in capsys.readouterr().err
    with pytest.raises(Exception, match="cannot import module"):
        user_model("still_missing:build", ModelSchema((), Feature("label", "float", ()), "binary"))


def test_evaluation_follows_the_task_not_binary_labels():
    """Regression reports mse and mae, multi-class the argmax's accuracy (a 4-class output used to
    break the binary accuracy's broadcast)."""
    from madp.training.options import TrainOptions
    from madp.training.tasks import NumericTask

    schema = {"x": Feature("x", "float", (2,)), "y": Feature("y", "float", ())}
    task = NumericTask(TrainOptions(mechanism="none", model="m:f", inputs=("x",), label="y", task="regression"), schema)
    x, y = np.array([[1, 2], [3, 4]], np.float32), np.array([1.0, 5.0], np.float32)
    metrics = task.evaluate(lambda x, training: x[:, :1], lambda y, out: (out[:, 0] - y) ** 2, (x, y))
    assert (task.headline, metrics) == ("mse", {"loss": 2.0, "mse": 2.0, "mae": 1.0})

    options = TrainOptions(mechanism="none", model="m:f", inputs=("x",), label="y", task="multiclass", classes=4)
    task = NumericTask(options, schema)
    outputs = np.eye(4, dtype=np.float32)[[0, 3, 2]]
    metrics = task.evaluate(
        lambda x, training: outputs, lambda y, out: np.zeros(len(y)), (x[:1].repeat(3, 0), np.array([0, 3, 1]))
    )
    assert metrics == {"loss": 0.0, "accuracy": round(2 / 3, 6)}
    assert task.problems({"y": np.array([0, 4, 1.5]), "weight": np.ones(3)}).tolist() == [
        "",
        *["label not in 0..3"] * 2,
    ]


@pytest.mark.parametrize("kind", ["BatchNormalization", "SyncBatchNormalization"])
def test_a_trainable_batch_normalization_is_refused_in_private_steps(data, kind):
    """It normalizes each row by the whole step's statistics and keeps them without noise; so does
    tf_keras' SyncBatchNormalization, whose class derives from BatchNormalizationBase alone."""
    import tf_keras

    from madp.training.steps import PrivateStep

    layer = getattr(tf_keras.layers, kind, None) or getattr(tf_keras.layers.experimental, kind)

    def model(trainable: bool):
        normalize = layer(center=False, scale=False)
        normalize.trainable = trainable
        return tf_keras.Sequential([tf_keras.layers.Input((4,)), normalize, tf_keras.layers.Dense(1)])

    query = DpSgdQuery(1.0, 1.0, SecretKey.for_run(0, "test noise", "--noise-seed"))
    with pytest.raises(InputError, match="BatchNormalization .* no DP guarantee covers"):
        PrivateStep(model(True), None, tf_keras.optimizers.SGD(0.1), query, 10.0)
    PrivateStep(model(False), None, tf_keras.optimizers.SGD(0.1), query, 10.0)  # frozen: inference only


def test_a_task_of_ones_own_encodes_rows_and_names_the_metrics(data, capsys):
    out = data / "own-task"
    argv = ["-q", "train", str(data / "batches"), str(out), "--model-path", str(data / "models"), "--label", "cls"]
    argv += [*SIGMA, "--eval-data", str(data / "test.jsonl"), "--eval-every", "20"]
    assert main([*argv, "--model", "four_classes:build", "--task", "top_k:task"]) == 0, capsys.readouterr().err
    final = evaluation_of(str(out), internal=True)["final"]
    assert set(final) == {"step", "loss", "top1", "top2"} and final["top2"] >= final["top1"] > 0.45
    assert json.load(open(out / "privacy.json"))["mechanism"] == "dpsgd"

    for task, model, expected in [
        ("top_k:no_metrics", "four_classes:build", "the task it returned has no metrics()"),
        ("top_k:task", "logreg", "--task module:function trains a --model module:function"),
        ("top_k:missing", "four_classes:build", "module 'top_k'"),
    ]:
        assert main([*argv[:-4], "--model", model, "--task", task]) == 2
        assert expected in capsys.readouterr().err
    mixed = [str(data / "mixed-rows") if arg == str(out) else arg for arg in argv[:-4]]  # a fresh OUTPUT
    assert main([*mixed, "--model", "four_classes:build", "--task", "top_k:standardized"]) == 2
    assert "encode(rows) gives input values that depend on the other rows" in capsys.readouterr().err
    assert not (data / "mixed-rows" / "model.keras").exists()
    assert main([*argv[:-4], "--model", "four_classes:build", "--task", "top_k:task", "--label", "label"]) == 2
    err = capsys.readouterr().err
    assert "must be features of the batches" in err and "--label 'label'" in err


HOSTILE = {  # --model, --task, and the error naming the function and what it did or returned
    "model raises": ("raising", "task", "--model hostile:raising: raising(schema) raised RuntimeError: no layer for"),
    "model returns no model": (
        "not_a_model",
        "task",
        "--model hostile:not_a_model: not_a_model(schema) must return (model, loss[, optimizer]): a tf_keras or "
        "Keras 3 model, a loss function and an optimizer of the model's Keras; it returned tuple ('a model', <function",
    ),
    "model returns no optimizer": (
        "not_an_optimizer",
        "task",
        ("of the model's Keras; it returned tuple (<tf_keras.src", "<function bui", ", 'adam')"),
    ),
    "model with NaN weights": (
        "nan_weights",
        "task",
        "--model hostile:nan_weights: the model nan_weights(schema) returned holds NaN or infinite weights (dense",
    ),
    "loss of NaN": (
        "nan_loss",
        "task",
        "--model hostile:nan_loss: its evaluation on --eval-data before the first step gives {'loss': nan}: the "
        "model's outputs or loss there are not finite numbers",
    ),
    "task raises": (
        "build",
        "task_raising",
        "--task hostile:task_raising: task_raising(features) raised KeyError: 'cls'",
    ),
    "encode raises": ("build", "encode_raising", "encode(rows) raised ValueError: no such column"),
    "encode returns one array": (
        "build",
        "encode_one_array",
        "--task hostile:encode_one_array: encode(rows) must return (x, y): the model's input (an array, or a dict of "
        "arrays by input name) and the labels; it returned ndarray",
    ),
    "encode returns too few labels": (
        "build",
        "encode_too_few_labels",
        "encode(rows) of 131 rows returned shapes {'input': (131, 4), 'label': (1,)}: one entry per row expected",
    ),
    "encode returns NaN": (
        "build",
        "encode_nan",
        "--task hostile:encode_nan: encode(rows) returned NaN or infinite input values for 118 of the 131 usable "
        "rows of step 0: fix encode, or give those rows a reason in problems",
    ),
    "metrics raises": (
        "build",
        "metrics_raising",
        "--task hostile:metrics_raising: metrics(labels, outputs) raised ZeroDivisionError: division by zero",
    ),
    "metrics returns text": (
        "build",
        "metrics_text",
        "metrics(labels, outputs) must return {name: number}, at least one; it returned dict {'accuracy': 'high'}",
    ),
    "metrics returns NaN": (
        "build",
        "metrics_nan",
        "metrics(labels, outputs) returned {'accuracy': nan}: not all finite numbers",
    ),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_user_code_that_fails_is_named_before_anything_is_trained_or_written(data, tmp_path, capsys, case):
    """Each was a traceback, or (NaN) exit 0 with a model trained on noise alone (DP-SGD's clipping gives a
    non-finite row no weight) and NaN in the evaluation file, which is not JSON. Now an error that names
    the function and what it raised or returned, before the first step: no model, metrics or privacy
    statement, and no training entered in the batches' ledger."""
    model, task, message = HOSTILE[case]
    out, ledger = tmp_path / "out", data / "batches" / "trainings.jsonl"
    before = ledger.read_text() if ledger.exists() else None
    argv = ["-q", "train", str(data / "batches"), str(out), "--model-path", str(data / "models"), "--label", "cls"]
    argv += [
        "--noise-multiplier",
        "1",
        "--noise-seed",
        "1",
        "--eval-data",
        str(data / "test.jsonl"),
        "--eval-every",
        "20",
    ]
    assert main([*argv, "--model", f"hostile:{model}", "--task", f"hostile:{task}"]) == 2
    err = capsys.readouterr().err
    assert all(fragment in err for fragment in ((message,) if isinstance(message, str) else message)), err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert not any((out / name).exists() for name in ("model.keras", "metrics.json", "privacy.json"))
    assert (ledger.read_text() if ledger.exists() else None) == before


# Models that trace, and one that fails as it runs: ids of hundreds into an Embedding of 4 (an error of the
# running graph, which no trace meets).
RUNTIME_MODULE = """
import tensorflow as tf
import tf_keras


def loss(labels, logits):
    labels = tf.cast(tf.reshape(labels, [-1]), tf.float32)
    return tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=tf.reshape(logits, [-1]))


def dense(schema):
    return tf_keras.Sequential([tf_keras.Input(shape=schema.inputs[0].shape), tf_keras.layers.Dense(1)]), loss


def embedding_past_its_vocabulary(schema):
    inputs = tf_keras.Input(shape=schema.inputs[0].shape)
    ids = tf_keras.layers.Lambda(lambda x: tf.cast(tf.abs(x) * 100.0, tf.int32))(inputs)
    embedded = tf_keras.layers.Flatten()(tf_keras.layers.Embedding(4, 2)(ids))
    return tf_keras.Model(inputs, tf_keras.layers.Dense(1)(embedded)), loss
"""


def test_a_module_model_that_fails_as_it_runs_is_named_and_leaves_nothing_behind(data, tmp_path, capsys):
    """A module:function model that fails as it runs (not as it is traced) was a traceback (exit 1) from
    its first step, or from its evaluation before the first step, after a private training had entered
    the trainings ledger and written its logs. Now one line names the model and TensorFlow's error, exit
    2, with no ledger entry and nothing written; an earlier training that --replace would replace stays."""
    records = str(data / "records.jsonl")
    bound_local(records, str(tmp_path / "bounded"), BoundOptions(max_contributions=2))
    batch_local(str(tmp_path / "bounded"), records, str(tmp_path / "batches"), BatchOptions(steps=8, batch_size=64))
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "runtime.py").write_text(RUNTIME_MODULE)
    ledger, out = tmp_path / "bounded" / "trainings.jsonl", tmp_path / "out"

    def train(model: str, *flags: str) -> int:
        argv = ["-q", "train", str(tmp_path / "batches"), str(out), "--model", f"runtime:{model}"]
        argv += ["--model-path", str(tmp_path / "models"), "--inputs", "a", "--noise-multiplier", "1", *flags]
        return main(argv)

    failing = "--model runtime:embedding_past_its_vocabulary: the model or its loss failed"
    for flags, when in (
        ((), "at step 1"),
        (("--eval-data", str(data / "test.jsonl")), "in its evaluation on --eval-data before the first step"),
    ):
        assert train("embedding_past_its_vocabulary", *flags) == 2
        err = capsys.readouterr().err
        assert f"{failing} {when}: InvalidArgumentError: indices[" in err and "is not in [0, 4)" in err, err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert not ledger.exists() and not [path for path in out.rglob("*") if path.is_file()]
    assert train("dense") == 0
    kept = {path: path.read_bytes() for path in out.rglob("*") if path.is_file()}
    assert train("embedding_past_its_vocabulary", "--replace", "--retrain") == 2  # composed with the first
    assert f"{failing} at step 1: InvalidArgumentError" in capsys.readouterr().err
    assert {path: path.read_bytes() for path in out.rglob("*") if path.is_file()} == kept
    assert [entry["state"] for entry in map(json.loads, ledger.read_text().splitlines())] == ["finished"]


def test_a_loss_that_raises_or_is_not_a_number_is_named_without_eval_data(data, tmp_path, capsys):
    """Without --eval-data, a module:function model whose loss raised a Python exception as the step was
    traced was a traceback (exit 1), and one whose loss is NaN trained on noise alone (DP-SGD's clipping
    gives a non-finite row no weight) and exited 0, publishing model.keras. Now each is one line naming the
    model and where, exit 2: before the first step nothing is written and nothing entered in the ledger;
    a loss that is NaN only on the trained model, or a madp model whose weights diverged, stops before
    model.keras and metrics.json are written (the private training's ledger entry stays: its steps ran)."""
    records = str(data / "records.jsonl")
    bound_local(records, str(tmp_path / "bounded"), BoundOptions(max_contributions=2))
    batch_local(str(tmp_path / "bounded"), records, str(tmp_path / "batches"), BatchOptions(steps=8, batch_size=64))
    ledger = tmp_path / "bounded" / "trainings.jsonl"

    def train(out: str, *flags: str) -> str:
        argv = ["-q", "train", str(tmp_path / "batches"), str(tmp_path / out), *flags]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert not any((tmp_path / out / name).exists() for name in ("model.keras", "metrics.json", "privacy.json"))
        return err

    user = ["--model-path", str(data / "models"), "--task", "hostile:task", "--label", "cls", "--noise-multiplier", "1"]
    raised = "its loss failed at step 1: ValueError: labels of the wrong rank"
    for model, message in (
        ("loss_raising", f"--model hostile:loss_raising: {raised}"),
        ("loss_raising_when_traced", f"--model hostile:loss_raising_when_traced: {raised}"),
        ("nan_loss", "--model hostile:nan_loss: its loss is NaN or infinite on "),
    ):
        err = train(model, *user, "--model", f"hostile:{model}")
        assert message in err, err
        assert not ledger.exists() and not [path for path in (tmp_path / model).rglob("*") if path.is_file()]
    assert "usable rows of step 1: the model's outputs or its loss there are not numbers" in err
    assert "fix the model or its loss; this step did not run" in err

    err = train("trained", *user, "--model", "hostile:nan_when_trained")
    assert "--model hostile:nan_when_trained: its loss is NaN or infinite on " in err, err
    assert "usable rows of step 8 after the training" in err
    assert "no model.keras or metrics.json is written, and the trainings ledger keeps its entry" in err
    assert [entry["state"] for entry in map(json.loads, ledger.read_text().splitlines())] == ["finished"]

    madp_model = ["--model", "logreg", "--inputs", "a", "--label", "label", "--mechanism", "none"]
    err = train("diverged", *madp_model, "--optimizer", "adam", "--learning-rate", "1e38")
    assert "--model logreg: its weights hold NaN or infinite values after the training (dense" in err, err
    assert "the training diverged (e.g. at too high a --learning-rate); no model.keras or metrics.json" in err


def test_metrics_that_fail_after_training_keep_the_model_and_its_guarantee(data, tmp_path, capsys):
    """metrics() that works on the untrained model and raises at the first evaluation of the trained one
    (step 20 of 40) was a traceback after the training's privacy budget was spent, the model lost. Now
    the training runs all its steps and saves model.keras and privacy.json, writes no metrics.json (no
    evaluation to publish with the model), and fails naming metrics() and the step."""
    out = tmp_path / "out"
    argv = ["-q", "train", str(data / "batches"), str(out), "--model-path", str(data / "models"), "--label", "cls"]
    argv += [
        "--noise-multiplier",
        "1",
        "--noise-seed",
        "1",
        "--eval-data",
        str(data / "test.jsonl"),
        "--eval-every",
        "20",
    ]
    assert main([*argv, "--model", "hostile:build", "--task", "hostile:metrics_raising_later"]) == 2
    err = capsys.readouterr().err
    assert "--task hostile:metrics_raising_later: metrics(labels, outputs) raised IndexError: list index out of " in err
    assert "(at step 20); the training ran all its steps: " in err and "Traceback" not in err
    assert (out / "model.keras").exists() and not (out / "metrics.json").exists()
    assert not (out / "internal" / "evaluation.json").exists()
    privacy = json.load(open(out / "privacy.json"))
    assert privacy["mechanism"] == "dpsgd" and privacy["steps"] == 40


def test_an_evaluation_that_is_not_a_finite_number_stops_the_training(data, tmp_path, capsys):
    """A logistic regression trained without noise at a learning rate of 1e38 overflows: its evaluation was
    infinite, written as Infinity into internal/evaluation.json (not JSON), and madp train exited 0. Now the
    evaluation that is not a finite number stops it, naming the model and the step; nothing claims a result."""
    out = tmp_path / "out"
    argv = ["-q", "train", str(data / "batches"), str(out), "--model", "logreg", "--inputs", "a", "--label", "label"]
    argv += ["--mechanism", "none", "--learning-rate", "1e38", "--eval-data", str(data / "test.jsonl")]
    assert main([*argv, "--eval-every", "20"]) == 2
    err = capsys.readouterr().err
    assert "--model logreg: its evaluation on --eval-data at step 20 gives {'loss': inf}: the model's outputs" in err
    assert not any((out / name).exists() for name in ("model.keras", "metrics.json", "internal/evaluation.json"))
