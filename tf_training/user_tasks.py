"""The user's code: `--model module:function` (`user_model`: a model and loss built from the
`ModelSchema` of the batches' features) and `--task module:function` (`UserTask`: how a step's rows
become the model's inputs and labels, and the evaluation's metrics), each call of it checked, and
what it raises or returns wrong an InputError naming the function, without a traceback
(`_user_call`, `user_model_failures`)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import math
import os
import reprlib
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from madp.core.batch_files import Feature
from madp.core.errors import InputError, OptionError, one_line
from madp.training import load_tensorflow
from madp.training.options import TrainOptions
from madp.training.task_rows import EVAL_ROWS, NUMPY_DTYPES, eval_texts, non_finite_rows, read_columns, row_range

tf = load_tensorflow()
import tf_keras  # noqa: E402

TEXT_MODELS = ("text-classifier", "text-lm", "causal-lm")  # madp's own text models (`tasks`), beside logreg and mlp


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
        return int(np.prod(np.array(self.inputs[0].shape, dtype=np.int64)))


def _returned(value: Any) -> str:
    """What the user's code returned, for an error: its type and a short repr."""
    return f"{type(value).__name__} {reprlib.repr(value)}"


def _user_call(flag: str, spec: str, call: str, function, *args, error: type[InputError] = InputError):
    """`function(*args)`, a function of the user's code (`flag spec`, called as `call`): an exception it
    raises is an `error` that names the function and the exception, on one line (no traceback)."""
    try:
        return function(*args)
    except Exception as failure:  # noqa: BLE001 - the user's code failed: say which function and how
        raise error(f"{flag} {spec}: {call} raised {one_line(failure)}") from None


def _user_function(spec: str, flag: str, model_path: tuple[str, ...] = ()):
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
    built = _user_call("--model", name, call, _user_function(name, "--model", model_path), schema)
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

    def __init__(self, options: TrainOptions, features: Mapping[str, Feature]):
        self.options = options
        features = dict(features)  # the user's function gets a dict of its own (the batches' schema stays as read)
        function = _user_function(options.task, "--task", options.model_path)
        self.task = _user_call("--task", options.task, f"{options.task.split(':', 1)[1]}(features)", function, features)
        where = f"--task {options.task}"
        for name in ("encode", "metrics"):
            if not callable(getattr(self.task, name, None)):
                raise InputError(
                    f"{where}: the task it returned has no {name}() (see docs/how-to/train.md, A model of your own)"
                )
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
        return _user_call("--task", self.options.task, call, function, *args, error=error)

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
            bad = problems != ""
            raise OptionError("{eval_data} {0}: {1} rows: {2}", path, int(bad.sum()), problems[bad][0])
        self.refuse_non_finite(x, y, np.ones(len(problems), bool), f"--eval-data {path}")
        return x, y

    def _array(self, name: str, values: list) -> np.ndarray:
        """An evaluation column as the batches' rows hold the feature (texts as UTF-8 bytes)."""
        dtype = self.features[name].dtype
        return eval_texts(values) if dtype == "bytes" else np.asarray(values, NUMPY_DTYPES[dtype])

    def evaluate(self, model, loss_fn, data) -> dict:
        x, y = data
        rows = len(tf.nest.flatten(x)[0])
        outputs = np.concatenate(
            [np.asarray(model(row_range(x, i, i + EVAL_ROWS), training=False)) for i in range(0, rows, EVAL_ROWS)]
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


def _is_number(value: Any) -> bool:
    """A real number (a Python or numpy scalar, or a 0-d array of one), not a boolean."""
    array = np.asarray(value)
    return array.ndim == 0 and array.dtype.kind in "iuf"


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
