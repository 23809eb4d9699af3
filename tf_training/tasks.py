"""What a model learns from a step's rows: a task turns batch features into model inputs and labels,
names the rows it cannot use, builds the model, and evaluates it on held-out records.

- `NumericTask`: fixed-shape features (one, or several by name) and a binary, multi-class or regression
  label (`logreg`, `mlp`, `module:function`, whose function gets a `ModelSchema`);
- `TextClassifierTask` (`text-classifier`): a text feature and a label among `--labels` (with
  --pretrained, also a frozen feature of the pretrained model's token embeddings);
- `ByteLmTask` (`text-lm`): a text feature, next-byte prediction;
- `CausalLmTask` (`causal-lm`): a text feature, next-token prediction by a pretrained model (--pretrained).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import importlib
import json
import logging
import math
import os
import reprlib
import sys
from typing import Any

import numpy as np

from madp.core import storage
from madp.core.batch_files import USER_FEATURE
from madp.core.errors import InputError, one_line
from madp.training import load_tensorflow, pretrained, text
from madp.training.batches import Batches, recorded_rows_per_step
from madp.training.bpe_tokenizer import token_sequences
from madp.training.data import step_batches
from madp.training.options import TrainOptions, training_defaults

tf = load_tensorflow()
import tf_keras  # noqa: E402

log = logging.getLogger("madp.train")
TEXT_MODELS = ("text-classifier", "text-lm", "causal-lm")
_EVAL_ROWS = 512


@dataclasses.dataclass(frozen=True)
class Feature:
    """One feature of the batches, as their schema.json describes it."""

    name: str
    dtype: str  # "float" (float32), "int64" or "bytes" (strings)
    shape: tuple[int, ...]  # per row: () a scalar, (16,) a vector


@dataclasses.dataclass(frozen=True)
class ModelSchema:
    """What `function(schema)` of `--model module:function` is given to build its model from.

    The model is called on `inputs[0]`'s array when there is one input, else on a dict {feature name:
    array} (name the Keras `Input`s after the features); its outputs are one logit per row (binary),
    `classes` logits or probabilities per row (multiclass: labels are 0..classes-1, int32), or the
    label's shape (regression, float32)."""

    inputs: tuple[Feature, ...]
    label: Feature
    task: str  # "binary" | "multiclass" | "regression"
    classes: int | None = None

    @property
    def input_dim(self) -> int:
        """The width of the first input (the one-vector models' only dimension)."""
        return int(np.prod(self.inputs[0].shape, dtype=np.int64))


def binary_logistic_loss(labels, logits):
    """Per-example loss of a one-logit binary classifier."""
    return tf.nn.sigmoid_cross_entropy_with_logits(
        labels=tf.cast(tf.reshape(labels, [-1]), tf.float32), logits=tf.reshape(logits, [-1])
    )


def build_model(name: str, input_dim: int, model_path: tuple[str, ...] = ()):
    """(Keras model, per-example loss) of `logreg`, `mlp`, or (a one-vector binary schema) module:function."""
    if name == "logreg":
        return tf_keras.Sequential([tf_keras.layers.Dense(1, input_shape=(input_dim,))]), binary_logistic_loss
    if name == "mlp":
        return tf_keras.Sequential(
            [tf_keras.layers.Dense(64, activation="relu", input_shape=(input_dim,)), tf_keras.layers.Dense(1)]
        ), binary_logistic_loss
    schema = ModelSchema((Feature("features", "float", (input_dim,)),), Feature("label", "float", ()), "binary")
    return user_model(name, schema, model_path)[:2]


def _returned(value: Any) -> str:
    """What the user's code returned, for an error: its type and a short repr."""
    return f"{type(value).__name__} {reprlib.repr(value)}"


def user_call(flag: str, spec: str, call: str, function, *args, error: type[InputError] = InputError):
    """`function(*args)`, a function of the user's code (`flag spec`, called as `call`): an exception it
    raises is an `error` that names the function and the exception, on one line (no traceback)."""
    try:
        return function(*args)
    except Exception as failure:  # noqa: BLE001 - the user's code failed: say which function and how
        raise error(f"{flag} {spec}: {call} raised {one_line(failure)}") from None


def user_function(spec: str, flag: str, model_path: tuple[str, ...] = ()):
    """The function of `module:function` (`--model`, `--task`). The module is looked up in `model_path`,
    then the current directory, then sys.path (PYTHONPATH); an import failure is an InputError naming it."""
    module_name, function_name = spec.split(":", 1)
    searched = [os.path.abspath(d) for d in model_path] + [os.getcwd()]
    saved = list(sys.path)
    sys.path[:0] = [d for d in searched if d not in sys.path]  # only for this import: the user's code, first
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        where = ", ".join(searched) + ", PYTHONPATH"
        raise InputError(f"{flag} {spec}: cannot import module {module_name!r} ({error}; searched {where})") from None
    except Exception as error:  # noqa: BLE001 - the user's module failed while importing: say which
        raise InputError(f"{flag} {spec}: importing module {module_name!r} failed: {one_line(error)}") from None
    finally:
        sys.path[:] = saved
    function = getattr(module, function_name, None)
    if not callable(function):
        raise InputError(f"{flag} {spec}: module {module_name!r} ({module.__file__}) has no {function_name!r}")
    return function


def user_model(name: str, schema: ModelSchema, model_path: tuple[str, ...] = ()) -> tuple:
    """(model, loss, optimizer or None) from `--model module:function`: `function(schema)` returns
    (model, loss) or (model, loss, optimizer), a tf_keras or Keras 3 model whose weights are finite
    numbers; anything else, or an exception it raises, is an InputError naming the function."""
    if ":" not in name:
        raise InputError(f"--model must be logreg, mlp, {', '.join(TEXT_MODELS)} or module:function, got {name!r}")
    call = f"{name.split(':', 1)[1]}(schema)"
    built = user_call("--model", name, call, user_function(name, "--model", model_path), schema)
    if isinstance(built, tuple) and len(built) in (2, 3):
        model, loss, optimizer = (*built, None)[:3]
    else:
        model = loss = optimizer = None
    if not (_is_keras_model(model) and callable(loss) and (optimizer is None or _is_optimizer(optimizer))):
        raise InputError(
            f"--model {name}: {call} must return (model, loss[, optimizer]): a tf_keras or Keras 3 model, a loss "
            f"function and an optimizer of the model's Keras; it returned {_returned(built)}"
        )
    broken = non_finite_weights(model.weights)
    if broken:
        raise InputError(
            f"--model {name}: the model {call} returned holds NaN or infinite weights ({', '.join(broken[:3])}): it "
            f"would compute NaN for every row, which DP-SGD's clipping gives no weight (a model of noise alone)"
        )
    return model, _named_loss(name, loss), optimizer


def non_finite_weights(weights) -> list[str]:
    """The names of the `weights` (a model's variables) that hold a NaN or infinite value; a Keras 3
    variable's path names its layer, as a tf_keras variable's name does."""
    return [getattr(weight, "path", weight.name) for weight in weights if not np.isfinite(np.asarray(weight)).all()]


class UserLossFailed(InputError):
    """The loss of a `--model module:function` raised a Python exception (as a step is traced, or as the
    model is evaluated): `user_model_failures` says where."""

    ag_pass_through = True  # TensorFlow's autograph lets it out of a traced step as it is, not as a StagingError

    def __init__(self, model: str, failure: Exception):
        self.model, self.failure = model, one_line(failure)
        super().__init__(f"--model {model}: its loss raised {self.failure}")


def _named_loss(model: str, loss):
    """The loss of `--model model`, a Python exception it raises an UserLossFailed naming the model: traced
    into a step, it would otherwise reach the user as a traceback through madp's clipping code. An op that
    fails as it runs is TensorFlow's OpError, which `user_model_failures` names as it is."""

    def named(labels, outputs):
        try:
            return loss(labels, outputs)
        except tf.errors.OpError:
            raise
        except Exception as failure:  # noqa: BLE001 - the user's loss failed: say which and how
            raise UserLossFailed(model, failure) from None

    return named


def _is_keras_model(value: Any) -> bool:
    """A tf_keras model, or a Keras 3 one (Keras 3 is then imported: the model's code did)."""
    keras = sys.modules.get("keras")
    return isinstance(value, tf_keras.Model) or (keras is not None and isinstance(value, keras.Model))


def _is_optimizer(value: Any) -> bool:
    return callable(getattr(value, "apply_gradients", None))


def is_keras3(model) -> bool:
    """A Keras 3 (`import keras`) model rather than a tf_keras one: it needs a Keras 3 optimizer."""
    return not isinstance(model, tf_keras.Model)


def default_optimizer(model, options: TrainOptions):
    """--optimizer at --learning-rate with --adam-epsilon (or the model's defaults), from the Keras
    of `model` (a tf_keras optimizer cannot update Keras 3 variables, nor the reverse)."""
    if is_keras3(model):
        import keras  # Keras 3: imported only for such models

        optimizers: Any = keras.optimizers
    else:
        optimizers = tf_keras.optimizers
    settings = training_defaults(options)
    if settings.name == "sgd":
        return optimizers.SGD(settings.learning_rate)
    return optimizers.Adam(settings.learning_rate, epsilon=settings.adam_epsilon)


def read_columns(path: str, names: list[str]) -> dict[str, list]:
    """Columns `names` of a .jsonl or Parquet evaluation file (or directory of Parquet files)."""
    if path.endswith(".parquet") or storage.kind(path) == "directory":
        table = storage.read_parquet(path, names)
        return {name: table.column(name).to_pylist() for name in names}
    rows = [json.loads(line) for line in storage.read_text(path).splitlines() if line.strip()]
    missing = [name for name in names if rows and name not in rows[0]]
    if missing:
        raise InputError(f"--eval-data {path}: no column {missing} (found {sorted(rows[0])})")
    return {name: [row.get(name) for row in rows] for name in names}


def _texts(values: list) -> np.ndarray:
    """Evaluation text values as UTF-8 bytes (None stays None, so it is reported as empty)."""
    out = np.empty(len(values), dtype=object)
    for row, value in enumerate(values):
        try:
            out[row] = value.encode("utf-8") if isinstance(value, str) else (value or b"")
        except UnicodeEncodeError:  # lone surrogates in JSON text
            out[row] = b"\xff"
    return out


_NUMPY_DTYPES = {"float": np.float32, "int64": np.int64, "bytes": object}


class NumericTask:
    """Features in (one array, or a dict of them by name: --inputs), a label out (--task: binary 0/1,
    multiclass 0..N-1, regression); evaluation loss with accuracy, or mean squared and absolute error."""

    def __init__(self, options: TrainOptions, schema: dict):
        features = schema["features"]

        def feature(name: str, flag: str) -> Feature:
            found = features.get(name)
            if found is None or None in found["shape"]:
                raise InputError(
                    f"{flag} {name!r} must name a fixed-shape feature of the batches (found {sorted(features)})"
                )
            return Feature(name, found["dtype"], tuple(int(n) for n in found["shape"]))

        flag = "--inputs" if options.inputs else "--features"
        inputs = tuple(feature(name, flag) for name in options.input_features)
        self.schema = ModelSchema(inputs, feature(options.label, "--label"), options.task, options.classes)
        if options.model in ("logreg", "mlp") and (
            len(inputs) != 1 or len(inputs[0].shape) != 1 or options.task != "binary"
        ):
            raise InputError(f"--model {options.model} takes one vector feature and --task binary")
        self.options, self.input_dim = options, self.schema.input_dim
        self.names = list(options.batch_features or ())
        self.headline = "mse" if options.task == "regression" else "accuracy"
        self.optimizer = None  # what a module:function model returned, if it did

    def build(self):
        if self.options.model in ("logreg", "mlp"):
            return build_model(self.options.model, self.input_dim)
        model, loss, self.optimizer = user_model(self.options.model, self.schema, self.options.model_path)
        return model, loss

    def trained(self, output: str):
        """(model, per-example loss) with the weights a finished `madp train` OUTPUT saved, in the
        model's own Keras (tf_keras or Keras 3)."""
        model, loss = self.build()
        model.load_weights(storage.join(output, "model.keras"))
        return model, loss

    def problems(self, rows: dict) -> np.ndarray:
        problems = np.full(len(rows["weight"]), "", dtype=object)
        if self.options.task == "multiclass":  # a label the outputs have no class for
            y = np.asarray(rows[self.options.label]).reshape(len(problems), -1)[:, 0]
            problems[(y < 0) | (y >= (self.options.classes or 0)) | (y != np.round(y))] = (
                f"label not in 0..{(self.options.classes or 0) - 1}"
            )
        return problems

    def _inputs(self, columns: dict):
        """The model's input: one array, or a dict of arrays by feature name (several --inputs)."""
        arrays = {f.name: np.asarray(columns[f.name], dtype=_NUMPY_DTYPES[f.dtype]) for f in self.schema.inputs}
        return arrays[self.schema.inputs[0].name] if len(arrays) == 1 else arrays

    def _labels(self, values) -> np.ndarray:
        if self.options.task == "multiclass":
            return np.asarray(values).astype(np.int32)
        return np.asarray(values, dtype=np.float32)

    def encode(self, rows: dict) -> tuple:
        problems = self.problems(rows)
        labels = rows[self.options.label]
        y = self._labels(np.where(problems == "", labels, 0) if problems.any() else labels)  # skipped: weight 0
        return self._inputs(rows), y, problems

    def read_eval(self, path: str) -> tuple:
        columns = read_columns(path, self.names)
        x, y = self._inputs(columns), self._labels(columns[self.options.label])
        if self.options.task == "multiclass":
            problems = self.problems({**columns, "weight": y})
            bad = problems != ""
            if bad.any():
                raise InputError(f"--eval-data {path}: {int(bad.sum())} rows: {problems[bad][0]}")
        return x, y

    def evaluate(self, model, loss_fn, data) -> dict:
        x, y = data
        rows = len(y)
        outputs = np.concatenate(
            [np.asarray(model(_rows(x, i, i + _EVAL_ROWS), training=False)) for i in range(0, rows, _EVAL_ROWS)]
        )
        loss = round(float(np.mean(loss_fn(y, outputs))), 6)
        if self.options.task == "binary":
            right = (outputs.reshape(-1) > 0) == (y.reshape(-1) > 0.5)  # one logit per row
            return {"loss": loss, "accuracy": round(float(np.mean(right)), 6)}
        if self.options.task == "multiclass":
            predicted = outputs.reshape(rows, -1).argmax(axis=1)
            return {"loss": loss, "accuracy": round(float(np.mean(predicted == y.reshape(-1))), 6)}
        error = outputs.reshape(rows, -1) - y.reshape(rows, -1)
        return {"loss": loss, "mse": round(float(np.mean(error**2)), 6), "mae": round(float(np.mean(np.abs(error))), 6)}


def _rows(x, start: int, stop: int):
    """Rows start..stop of an input array, or of each array of a dict of inputs."""
    return tf.nest.map_structure(lambda a: a[start:stop], x)


def _encoded_arrays(encoded: tuple) -> dict[str, np.ndarray]:
    """An encode's (x, y) as named arrays: the model's input (an array, or a dict by input name) and y."""
    x, y = encoded
    inputs = {f"input {name!r}": value for name, value in x.items()} if isinstance(x, dict) else {"input": x}
    return {**{name: np.asarray(value) for name, value in inputs.items()}, "label": np.asarray(y)}


class UserTask:
    """`--task module:function`: `function(features)` ({name: Feature} of every batch feature) returns
    the user's task, an object with

    - `features`: the batch features a step's rows need (the label's among them);
    - `encode(rows)` -> (x, y): a step's (or the evaluation data's) rows, {feature: numpy array}, as
      the model's input (an array, or a dict of arrays by input name) and the labels the loss takes;
    - `metrics(labels, outputs)` -> {name: number}: the evaluation, on the labels and the model's
      outputs over all of --eval-data (madp adds the mean loss); the first is the headline;
    - optionally `problems(rows)` -> why each row cannot be used ("" where it can; the others train with
      weight 0 under --on-invalid skip, as the built-in tasks' unusable rows do).

    Its model is `--model module:function`, given the ModelSchema of the task's features (the --label
    one as the label, the others as inputs, `task` the task's name). Only the model and the training
    rows decide the published model; `encode` computes each row from that row alone (checked on the
    first rows it encodes, `_refuse_mixed_rows`)."""

    def __init__(self, options: TrainOptions, schema: dict):
        self.options = options
        features = {
            name: Feature(name, found["dtype"], tuple(found["shape"])) for name, found in schema["features"].items()
        }
        function = user_function(options.task, "--task", options.model_path)
        self.task = user_call("--task", options.task, f"{options.task.split(':', 1)[1]}(features)", function, features)
        where = f"--task {options.task}"
        for name in ("encode", "metrics"):
            if not callable(getattr(self.task, name, None)):
                raise InputError(f"{where}: the task it returned has no {name}() (see the README's own tasks)")
        names = getattr(self.task, "features", None)
        if not isinstance(names, (list, tuple)) or not names or not all(isinstance(n, str) for n in names):
            raise InputError(f"{where}: the task's features must be a list of batch feature names")
        unknown = [name for name in names if name not in features]
        if unknown or options.label not in names:
            raise InputError(
                f"{where}: its features {list(names)} must be features of the batches ({sorted(features)}) and "
                f"hold the label --label {options.label!r}"
            )
        self.names = list(names)
        self.features = features
        self.schema = ModelSchema(
            tuple(features[n] for n in names if n != options.label), features[options.label], options.task
        )
        self.headline = "loss"  # until the first evaluation names the task's first metric
        self.optimizer = None  # what the module:function model returned, if it did
        self.rows_checked = False  # whether encode was seen to encode each row from that row alone

    def build(self):
        model, loss, self.optimizer = user_model(self.options.model, self.schema, self.options.model_path)
        return model, loss

    def _call(self, call: str, function, *args, error: type[InputError] = InputError):
        return user_call("--task", self.options.task, call, function, *args, error=error)

    def problems(self, rows: dict) -> np.ndarray:
        count = len(rows[self.names[0]])
        given = callable(getattr(self.task, "problems", None))
        found = self._call("problems(rows)", self.task.problems, rows) if given else None
        problems = np.full(count, "", dtype=object) if found is None else np.asarray(found, dtype=object)
        if problems.shape != (count,):
            raise InputError(
                f"--task {self.options.task}: problems(rows) must give one reason per row ({count}); it returned "
                f"{_returned(found)}"
            )
        return problems

    def encode(self, rows: dict) -> tuple:
        x, y = self._encoded(rows)
        if not self.rows_checked and len(y) >= 2:
            self._refuse_mixed_rows(rows)
        return x, y, self.problems(rows)

    def _encoded(self, rows: dict) -> tuple:
        """The task's encode(rows), checked: (x, y), x an array or a dict of arrays by input name, each
        of them and y with one entry per row."""
        found = self._call("encode(rows)", self.task.encode, rows)
        where, count = f"--task {self.options.task}: encode(rows)", len(rows[self.names[0]])
        if not (isinstance(found, tuple) and len(found) == 2):
            raise InputError(
                f"{where} must return (x, y): the model's input (an array, or a dict of arrays by input name) and "
                f"the labels; it returned {_returned(found)}"
            )
        try:
            shapes = {name: array.shape for name, array in _encoded_arrays(found).items()}
        except (ValueError, TypeError) as error:  # ragged lists, or values numpy cannot hold in an array
            raise InputError(f"{where} returned values that are not arrays ({one_line(error)})") from None
        if any(shape[:1] != (count,) for shape in shapes.values()):
            raise InputError(f"{where} of {count} rows returned shapes {shapes}: one entry per row expected")
        return found

    def refuse_non_finite(self, x, y, usable: np.ndarray, rows_of: str) -> None:
        """Refuse an encoding whose usable rows hold NaN or infinite features or labels: a training on
        them learns nothing (DP-SGD's clipping gives a non-finite row no weight: a model of noise
        alone) and evaluates to NaN. `rows_of` says whose rows they are (a step, the evaluation data).
        The rows are private: the error goes to the operator only, and nothing is written."""
        for name, array in _encoded_arrays((x, y)).items():
            if array.dtype.kind in "fc":
                bad = non_finite_rows(array, usable)
                if bad.any():
                    raise InputError(
                        f"--task {self.options.task}: encode(rows) returned NaN or infinite {name} values for "
                        f"{int(bad.sum())} of the {int(usable.sum())} usable rows of {rows_of}: fix encode, or "
                        f"give those rows a reason in problems(rows) (trained with weight 0 under --on-invalid skip)"
                    )

    def _refuse_mixed_rows(self, rows: dict, count: int = 8) -> None:
        """Clipping bounds what one row adds to a step only if a row's (x, y) depend on that row alone:
        an `encode` that standardizes by the step's statistics lets one record move every row. Checked
        once, on the first rows it encodes: a few rows encoded together and one by one."""
        some = {name: np.asarray(values)[:count] for name, values in rows.items()}
        together = _encoded_arrays(self._encoded(some))
        alone = [
            _encoded_arrays(self._encoded({name: values[i : i + 1] for name, values in some.items()}))
            for i in range(len(together["label"]))
        ]
        for name, joined in together.items():
            parts = np.concatenate([encoded[name] for encoded in alone])
            numeric = joined.dtype.kind in "biuf" and parts.dtype.kind in "biuf"
            same = joined.shape == parts.shape and (
                np.allclose(joined, parts, rtol=1e-5, atol=1e-6, equal_nan=True)
                if numeric
                else np.array_equal(joined, parts)
            )
            if not same:
                raise InputError(
                    f"--task {self.options.task}: encode(rows) gives {name} values that depend on the other rows "
                    f"(e.g. standardized by the step's mean): one record would move every row of its step, which "
                    f"clipping does not bound; compute each row from that row alone (constants from public data)"
                )
        self.rows_checked = True

    def read_eval(self, path: str) -> tuple:
        rows = {name: self._array(name, values) for name, values in read_columns(path, self.names).items()}
        x, y, problems = self.encode(rows)
        if (problems != "").any():
            raise InputError(f"--eval-data {path}: {int((problems != '').sum())} rows: {problems[problems != ''][0]}")
        self.refuse_non_finite(x, y, np.ones(len(problems), bool), f"--eval-data {path}")
        return x, y

    def _array(self, name: str, values: list) -> np.ndarray:
        """An evaluation column as the batches' rows hold the feature (texts as UTF-8 bytes)."""
        dtype = self.features[name].dtype
        return _texts(values) if dtype == "bytes" else np.asarray(values, _NUMPY_DTYPES[dtype])

    def evaluate(self, model, loss_fn, data) -> dict:
        x, y = data
        rows = len(tf.nest.flatten(x)[0])
        outputs = np.concatenate(
            [np.asarray(model(_rows(x, i, i + _EVAL_ROWS), training=False)) for i in range(0, rows, _EVAL_ROWS)]
        )
        where = f"--task {self.options.task}: metrics(labels, outputs)"
        found = self._call("metrics(labels, outputs)", self.task.metrics, y, outputs, error=MetricsFailed)
        if not (isinstance(found, dict) and found and all(_is_number(value) for value in found.values())):
            raise MetricsFailed(f"{where} must return {{name: number}}, at least one; it returned {_returned(found)}")
        figures = {str(name): float(value) for name, value in found.items()}
        if not all(math.isfinite(value) for value in figures.values()):
            raise MetricsFailed(f"{where} returned {figures}: not all finite numbers (metrics.json is JSON: no NaN)")
        self.headline = next(iter(figures))
        return {"loss": round(float(np.mean(loss_fn(y, outputs))), 6)} | {
            name: round(value, 6) for name, value in figures.items()
        }


class MetricsFailed(InputError):
    """A `--task module:function`'s metrics() raised, or returned something other than finite numbers by
    name: the user's evaluation failed, not the model (`madp train` keeps the model it trains)."""


class NotFinite(InputError):
    """The model computes no number: an evaluation, its loss on a step's rows or its weights are NaN or
    infinite. A checkpoint of it would stop a resume at the same place (`trainer._settled` removes it)."""


def _is_number(value: Any) -> bool:
    """A real number (a Python or numpy scalar, or a 0-d array of one), not a boolean."""
    array = np.asarray(value)
    return array.ndim == 0 and array.dtype.kind in "iuf"


def finite_evaluation(evaluation: dict, what: str) -> dict:
    """A task's evaluation, refused where one of its figures is NaN or infinite: `what` says whose
    evaluation, when ("--model mlp: its evaluation on --eval-data at step 20"). metrics.json is JSON,
    which has no NaN; and such a figure means a model that computes no number there."""
    bad = {name: value for name, value in evaluation.items() if isinstance(value, float) and not math.isfinite(value)}
    if bad:
        raise NotFinite(
            f"{what} gives {bad}: the model's outputs or loss there are not finite numbers (weights that diverged, "
            f"e.g. at too high a --learning-rate, or NaN or infinite values in --eval-data)"
        )
    return evaluation


def non_finite_rows(values: np.ndarray, usable: np.ndarray) -> np.ndarray:
    """Which of the `usable` rows (a mask) of `values` (one row per leading index) hold a NaN or infinity."""
    return usable & ~np.isfinite(values.reshape(len(values), -1)).all(axis=1)


def refuse_non_finite_loss(
    model, loss_fn, x, y, usable: np.ndarray, options: TrainOptions, rows_of: str, kept: str
) -> None:
    """Refuse a `--model module:function` whose loss on the usable rows of `rows_of` (a step's) is NaN or
    infinite (`kept`: what the training left). DP-SGD's clipping gives such a row no weight, so that one
    row cannot put NaN into the sum: a model whose outputs or loss are not numbers would train on noise
    alone and be published as trained. The model runs eagerly in inference mode (no randomness drawn) on
    the host's copy of the rows, outside the steps. The rows are private: the error goes to the operator."""
    losses = np.concatenate(
        [
            np.atleast_1d(loss_fn(y[i : i + _EVAL_ROWS], model(_rows(x, i, i + _EVAL_ROWS), training=False)))
            for i in range(0, len(y), _EVAL_ROWS)
        ]
    )
    if losses.shape[:1] != usable.shape:  # not one loss per row: the step refuses it as it is traced
        return
    bad = non_finite_rows(losses, usable)
    if bad.any():
        raise NotFinite(
            f"--model {options.model}: its loss is NaN or infinite on {int(bad.sum())} of the {int(usable.sum())} "
            f"usable rows of {rows_of}: the model's outputs or its loss there are not numbers, and DP-SGD's clipping "
            f"gives such rows no weight (a model trained on noise alone): fix the model or its loss; {kept}"
        )


class _TextTask:
    """Shared by the text tasks: the text feature must be a single string per row."""

    names: list[str]  # the batch features a step's rows need

    def __init__(self, options: TrainOptions, schema: dict):
        feature = schema["features"].get(options.text_column)
        if feature is None or feature["dtype"] != "bytes" or feature["shape"] != []:
            raise InputError(
                f"--text-column {options.text_column!r} must name a text feature of the batches "
                f"(one string per record; found {sorted(schema['features'])})"
            )
        self.options = options
        self.verdicts: dict = {}  # record id -> why its text cannot be used ("" where it can)

    def problems(self, rows: dict) -> np.ndarray:
        """Why each row cannot be used ("" where it can). Judging a text reads all of it (UTF-8, a letter
        or digit anywhere), so a record is judged once, by the id the batches' rows carry: a step that
        samples a long record again costs what its encoding reads (a bounded prefix), not its length."""
        texts, ids = rows[self.options.text_column], rows.get("id")
        if ids is None:  # evaluation data, an audit's canaries: not rows of the batches
            return text.text_problems(texts)
        records = ids.tolist()
        new = [row for row, record in enumerate(records) if record not in self.verdicts]
        for row, verdict in zip(new, text.text_problems(texts[new]).tolist(), strict=True):
            self.verdicts[records[row]] = verdict
        return np.array([self.verdicts[record] for record in records], dtype=object)


class TextClassifierTask(_TextTask):
    """Hashed n-grams of a text in, one of the given labels out; accuracy and macro-F1. With
    --pretrained, also the pretrained model's frozen token-embedding feature (`text.TokenFeatures`)."""

    headline = "accuracy"

    def __init__(self, options: TrainOptions, schema: dict, labels: list[str]):
        super().__init__(options, schema)
        if options.label not in schema["features"]:
            raise InputError(f"--label {options.label!r} is not a feature of the batches")
        self.labels = labels
        self.index = {label: i for i, label in enumerate(labels)}
        self.names = list(options.batch_features or ())
        self.features: text.TokenFeatures | None = None
        if options.pretrained is not None:  # read_pretrained checked the table: a finite row per token
            model = pretrained.read_pretrained(options.pretrained)
            self.features = text.TokenFeatures.of(model.tokenizer, model.layer_weights()["token_embd"][0])

    def build(self):
        o = self.options
        width = 0 if self.features is None else self.features.width
        return text.text_classifier(o.buckets, o.width or text.CLASSIFIER_WIDTH, o.max_length, len(self.labels), width)

    def label_indices(self, values) -> np.ndarray:
        """Each label's index in the label list, -1 where it is not in it."""
        return np.array([self.index.get(label_text(v), -1) for v in values], dtype=np.int32)

    def problems(self, rows: dict) -> np.ndarray:
        return self._problems_and_labels(rows)[0]

    def _problems_and_labels(self, rows: dict) -> tuple[np.ndarray, np.ndarray]:
        problems, y = super().problems(rows), self.label_indices(rows[self.options.label])
        problems[(problems == "") & (y < 0)] = text.UNKNOWN_LABEL
        return problems, y

    def encode(self, rows: dict) -> tuple[np.ndarray | dict[str, np.ndarray], np.ndarray, np.ndarray]:
        problems, y = self._problems_and_labels(rows)
        texts = np.where(problems == "", rows[self.options.text_column], b"")
        o = self.options
        ngrams = text.hashed_ngrams(texts, o.buckets, o.max_length, o.ngram_order, prefix=o.word_prefix_length)
        if self.features is None:
            return ngrams, np.maximum(y, 0), problems
        x = {text.NGRAMS: ngrams, text.PRETRAINED: self.features(texts, o.max_length)}
        return x, np.maximum(y, 0), problems

    def read_eval(self, path: str):
        columns = read_columns(path, [self.options.text_column, self.options.label])
        texts = _texts(columns[self.options.text_column])
        return _usable_eval(
            path, *self.encode({self.options.text_column: texts, self.options.label: columns[self.options.label]})
        )

    def evaluate(self, model, loss_fn, data) -> dict:
        x, y = data
        logits = np.concatenate(
            [model(_rows(x, i, i + _EVAL_ROWS), training=False) for i in range(0, len(y), _EVAL_ROWS)]
        )
        loss = float(np.mean(loss_fn(y, logits)))
        return {"loss": round(loss, 6), **text.classification_metrics(y, logits.argmax(axis=1), self.labels)}


class ByteLmTask(_TextTask):
    """A text's first --max-length bytes in, each next byte out; bits per byte and perplexity."""

    headline = "bits_per_byte"

    def __init__(self, options: TrainOptions, schema: dict):
        super().__init__(options, schema)
        self.names = list(options.batch_features or ())

    def build(self):
        o = self.options
        return text.byte_lm(o.max_length, o.width or 64, o.layers, o.heads)

    def encode(self, rows: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        texts = rows[self.options.text_column]
        problems = self.problems(rows)
        x, y = text.byte_sequences(np.where(problems == "", texts, b""), self.options.max_length)
        return x, y, problems

    def read_eval(self, path: str):
        texts = _texts(read_columns(path, [self.options.text_column])[self.options.text_column])
        return _usable_eval(path, *self.encode({self.options.text_column: texts}))

    def evaluate(self, model, loss_fn, data) -> dict:
        x, y = data
        return text.byte_metrics(*text.summed_sequence_loss(model, loss_fn, x, y, _EVAL_ROWS))


class CausalLmTask(_TextTask):
    """A pretrained causal LM (--pretrained: a GGUF file or a keras-hub preset directory) fine-tuned on
    a text's first --max-length tokens, with the model's own tokenizer: nothing of it is learned from
    the data. Loss and perplexity per token; `pretrained_eval` is the untrained model's, on the
    evaluation data."""

    headline = "perplexity"

    def __init__(self, options: TrainOptions, schema: dict):
        super().__init__(options, schema)
        self.names = list(options.batch_features or ())
        self.pretrained = pretrained.read_pretrained(options.pretrained or "")
        context = self.pretrained.config.context_length
        if context is not None and options.max_length > context:  # RoPE positions it never saw
            raise InputError(
                f"--max-length {options.max_length} exceeds the context length of --pretrained ({context} tokens)"
            )
        self.model = None
        self.pretrained_eval: dict | None = None

    def build(self):
        self.model = pretrained.pretrained_model(self.pretrained, self.options.max_length, self.options.lora_rank)
        return self.model, pretrained.next_token_loss

    def encode(self, rows: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        texts = rows[self.options.text_column]
        problems = self.problems(rows)
        usable = np.where(problems == "", texts, b"")
        x, y = token_sequences(self.pretrained.tokenizer, usable, self.options.max_length)
        return x, y, problems

    def read_eval(self, path: str):
        texts = _texts(read_columns(path, [self.options.text_column])[self.options.text_column])
        data = _usable_eval(path, *self.encode({self.options.text_column: texts}))
        if self.model is not None and self.pretrained_eval is None:  # the trainer reads it after build(),
            # before the first step (and before a --resume restores a checkpoint): the pretrained weights
            found = self.evaluate(self.model, pretrained.next_token_loss, data)
            what = f"--pretrained {self.options.pretrained}: the pretrained model's evaluation on --eval-data"
            self.pretrained_eval = finite_evaluation(found, what)
        return data

    def evaluate(self, model, loss_fn, data) -> dict:
        x, y = data
        return pretrained.mean_token_loss(model, x, y)


def label_text(value) -> str:
    """A label as the text --labels gives it: strings as they are, integers in decimal."""
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


def _usable_eval(path: str, x, y: np.ndarray, problems: np.ndarray):
    usable = problems == ""
    if not usable.any():
        raise InputError(f"--eval-data {path}: no usable row ({dict(zip(*np.unique(problems, return_counts=True)))})")
    if not usable.all():
        reasons = {str(k): int(v) for k, v in zip(*np.unique(problems[~usable], return_counts=True))}
        log.warning("--eval-data %s: %d rows left out of the evaluation: %s", path, int((~usable).sum()), reasons)
    return tf.nest.map_structure(lambda a: a[usable], x), y[usable]


class Skipped:
    """Rows of the batches a task cannot use, by reason: each trains with weight 0 (like padding)."""

    def __init__(self) -> None:
        self.rows: collections.Counter = collections.Counter()  # (record id, reason) -> rows
        self.first_step: dict = {}

    def add(self, step: int, ids: np.ndarray, reasons: np.ndarray) -> None:
        for record, reason in zip(ids.tolist(), reasons.tolist()):
            record = record.decode("utf-8", errors="replace") if isinstance(record, bytes) else record
            self.rows[record, reason] += 1
            self.first_step.setdefault((record, reason), step)

    def __len__(self) -> int:
        return len(self.rows)

    def counts(self) -> dict:
        """Skipped rows and distinct records per reason."""
        rows: collections.Counter = collections.Counter()
        records: collections.Counter = collections.Counter()
        for (_, reason), count in self.rows.items():
            rows[reason] += count
            records[reason] += 1
        return {"rows": dict(sorted(rows.items())), "records": dict(sorted(records.items()))}

    def examples(self, limit: int = 5) -> str:
        return "\n".join(
            f"  record {record!r} (first in step {self.first_step[record, reason]}): {reason}"
            for record, reason in sorted(self.rows, key=lambda key: self.first_step[key])[:limit]
        )

    def to_jsonl(self) -> str:
        return "".join(
            json.dumps({"id": record, "reason": reason, "rows": count}) + "\n"
            for (record, reason), count in sorted(self.rows.items(), key=lambda item: (item[0][1], str(item[0][0])))
        )


def step_features(task, batches: Batches) -> list[str]:
    """The batch features a training of `task` reads from each step: the task's, each row's `id` (the rows
    a task cannot use, --zero-out) and, on user-sampled batches, each row's user (clipped by user)."""
    return [*task.names, "id"] + ([USER_FEATURE] if batches.report["sampler"] == "users" else [])


def prepare_task(options: TrainOptions, batches: Batches):
    """(task, skipped rows): the task of --model, its label set (given, or read from the batches with a
    warning), and every real row it cannot use. Every step is read once, as the training reads it
    (`step_features`), before the training starts (so before its ledger entry): a row TensorFlow cannot
    parse as schema.json says (`data.step_batches` names its file) or a step of other than the rows the
    batch report records is refused here, not at the step that holds it."""
    task: _TextTask | NumericTask | UserTask
    if options.user_task:
        task = UserTask(options, batches.schema)
    elif options.model not in TEXT_MODELS:
        task = NumericTask(options, batches.schema)
    elif options.model == "text-lm":
        task = ByteLmTask(options, batches.schema)
    elif options.model == "causal-lm":
        task = CausalLmTask(options, batches.schema)
    else:
        labels = list(options.labels or ()) or _labels_in(options, batches)
        task = TextClassifierTask(options, batches.schema, labels)
    recorded = recorded_rows_per_step(batches.report)
    skipped = Skipped()
    for step, rows in step_batches(batches, step_features(task, batches)):
        if recorded is not None and len(rows["weight"]) != recorded[step]:
            raise InputError(
                f"{batches.directory}: step {step} holds {len(rows['weight'])} rows where its report records "
                f"{recorded[step]}: not the batches madp batch wrote; batch again"
            )
        problems = task.problems(rows)
        bad = (rows["weight"] > 0) & (problems != "")
        if bad.any():
            skipped.add(step, rows["id"][bad], problems[bad])
        if isinstance(task, UserTask):  # the user's encode, on every step before the first is trained
            x, y, _ = task.encode(rows)
            task.refuse_non_finite(x, y, (rows["weight"] > 0) & (problems == ""), f"step {step}")
    if len(skipped) and options.on_invalid == "error":
        counts = skipped.counts()["records"]
        raise InputError(
            f"{sum(counts.values())} records of the batches cannot be used by --model {options.model} "
            f"({', '.join(f'{k}: {v}' for k, v in counts.items())}):\n{skipped.examples()}\n"
            f"Fix them, or pass --on-invalid skip to train them with weight 0 (listed in OUTPUT/rejected/)"
        )
    return task, skipped


@contextlib.contextmanager
def user_model_failures(options: TrainOptions, when: str):
    """A TensorFlow run-time error (an op that failed as it ran: an index past an Embedding's vocabulary,
    shapes that do not fit) while a `--model module:function` model computes with its loss, as one
    InputError that names the model, what failed and where (`one_line`). Only for such models: in madp's
    own models an op that fails is madp's error, which keeps its traceback. Of Python's exceptions as a
    step is traced, which madp's clipping code raises too, only those of the model's loss, which reach
    here marked as its (`UserLossFailed`)."""
    try:
        yield
    except UserLossFailed as error:
        raise InputError(f"--model {error.model}: its loss failed {when}: {error.failure}") from None
    except tf.errors.OpError as error:
        if not options.user_model:
            raise
        raise InputError(f"--model {options.model}: the model or its loss failed {when}: {one_line(error)}") from None


def _labels_in(options: TrainOptions, batches: Batches) -> list[str]:
    """The labels of the batches' usable rows, sorted; the released model discloses them."""
    found: set[str] = set()
    for _, rows in step_batches(batches, [options.text_column, options.label, "weight"]):
        usable = (rows["weight"] > 0) & (text.text_problems(rows[options.text_column]) == "")
        found.update(label_text(v) for v in rows[options.label][usable])
    if not found:
        raise InputError(f"the batches hold no usable row with a label in {options.label!r}")
    labels = sorted(found)
    log.warning(
        "the label set was taken from the data (%s): the model and its metrics disclose it; "
        "give the public label set with --labels",
        ",".join(labels),
    )
    return labels
