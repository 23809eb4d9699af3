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
from madp.training.tasks import Feature, ModelSchema, user_model  # noqa: E402

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
    return directory


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
    argv += ["--epsilon", "8", "--eval-data", str(data / "test.jsonl"), "--eval-every", "20", *flags]
    assert main(argv) == 0, capsys.readouterr().err
    metrics = evaluation_of(str(out), internal=True)  # test.jsonl is not declared public
    privacy = json.load(open(out / "privacy.json"))
    assert privacy["mechanism"] == "dpsgd" and privacy["epsilon"] <= 8 + 1e-9  # (batches of a fixed seed: not private)
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
    features = batches.schema["features"]
    schema = ModelSchema(
        tuple(Feature(name, "float", tuple(features[name]["shape"])) for name in ("a", "b")),
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
        model, loss, keras.optimizers.SGD(0.5), calibrate(batches, epsilon=8), jit_compile=jit_compile,
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
        make_private(model, loss, tf_keras.optimizers.SGD(0.5), calibrate(batches, epsilon=8))


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

    schema = {"features": {"x": {"dtype": "float", "shape": [2]}, "y": {"dtype": "float", "shape": []}}}
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
    argv += ["--epsilon", "8", "--eval-data", str(data / "test.jsonl"), "--eval-every", "20"]
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
