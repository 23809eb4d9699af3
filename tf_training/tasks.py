"""What a model learns from a step's rows: a task turns batch features into model inputs and labels,
names the rows it cannot use, builds the model, and evaluates it on held-out records.

- `NumericTask`: a fixed-length float feature and a 0/1 label (`logreg`, `mlp`, `module:function`);
- `TextClassifierTask` (`text-classifier`): a text feature and a label among `--labels`;
- `ByteLmTask` (`text-lm`): a text feature, next-byte prediction.
"""

from __future__ import annotations

import collections
import importlib
import json
import logging

import numpy as np

from madp.core import storage
from madp.core.errors import InputError
from madp.training import load_tensorflow, text
from madp.training.batches import Batches
from madp.training.data import step_batches
from madp.training.options import TrainOptions

tf = load_tensorflow()
import tf_keras  # noqa: E402

log = logging.getLogger("madp.train")
TEXT_MODELS = ("text-classifier", "text-lm")
_EVAL_ROWS = 512


def binary_logistic_loss(labels, logits):
    """Per-example loss of a one-logit binary classifier."""
    return tf.nn.sigmoid_cross_entropy_with_logits(
        labels=tf.cast(tf.reshape(labels, [-1]), tf.float32), logits=tf.reshape(logits, [-1])
    )


def build_model(name: str, input_dim: int):
    """(Keras model, per-example loss): `logreg`, `mlp`, or `module:function` returning both."""
    if name == "logreg":
        return tf_keras.Sequential([tf_keras.layers.Dense(1, input_shape=(input_dim,))]), binary_logistic_loss
    if name == "mlp":
        return tf_keras.Sequential(
            [tf_keras.layers.Dense(64, activation="relu", input_shape=(input_dim,)), tf_keras.layers.Dense(1)]
        ), binary_logistic_loss
    if ":" not in name:
        raise InputError(f"--model must be logreg, mlp, {', '.join(TEXT_MODELS)} or module:function, got {name!r}")
    module, function = name.split(":", 1)
    try:
        return getattr(importlib.import_module(module), function)(input_dim)
    except (ImportError, AttributeError) as error:
        raise InputError(f"--model {name}: {error}") from error


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


class NumericTask:
    """A fixed-length float feature in, a 0/1 label out; evaluation loss and accuracy."""

    headline = "accuracy"

    def __init__(self, options: TrainOptions, schema: dict):
        feature = schema["features"].get(options.features)
        if feature is None or len(feature["shape"]) != 1 or feature["shape"][0] is None:
            raise InputError(
                f"--features {options.features!r} must name a fixed-length feature of the batches "
                f"(found {sorted(schema['features'])})"
            )
        self.options, self.input_dim = options, int(feature["shape"][0])
        self.names = [options.features, options.label]

    def build(self):
        return build_model(self.options.model, self.input_dim)

    def problems(self, rows: dict) -> np.ndarray:
        return np.full(len(rows["weight"]), "", dtype=object)

    def encode(self, rows: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        x, y = rows[self.options.features].astype(np.float32), rows[self.options.label].astype(np.float32)
        return x, y, self.problems(rows)

    def read_eval(self, path: str) -> tuple[np.ndarray, np.ndarray]:
        columns = read_columns(path, [self.options.features, self.options.label])
        return (
            np.array(columns[self.options.features], dtype=np.float32),
            np.array(columns[self.options.label], dtype=np.float32),
        )

    def evaluate(self, model, loss_fn, data) -> dict:
        x, y = data
        logits = model(x, training=False)
        loss = float(tf.reduce_mean(loss_fn(y, logits)))
        accuracy = float(np.mean((np.asarray(logits).reshape(-1) > 0) == (y > 0.5)))
        return {"loss": round(loss, 6), "accuracy": round(accuracy, 6)}


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

    def problems(self, rows: dict) -> np.ndarray:
        """Why each row cannot be used ("" where it can)."""
        return text.text_problems(rows[self.options.text_column])


class TextClassifierTask(_TextTask):
    """Hashed n-grams of a text in, one of the given labels out; accuracy and macro-F1."""

    headline = "accuracy"

    def __init__(self, options: TrainOptions, schema: dict, labels: list[str]):
        super().__init__(options, schema)
        if options.label not in schema["features"]:
            raise InputError(f"--label {options.label!r} is not a feature of the batches")
        self.labels = labels
        self.index = {label: i for i, label in enumerate(labels)}
        self.names = [options.text_column, options.label]

    def build(self):
        o = self.options
        return text.text_classifier(o.buckets, o.width or 32, o.max_length, len(self.labels))

    def label_indices(self, values) -> np.ndarray:
        """Each label's index in the label list, -1 where it is not in it."""
        return np.array([self.index.get(label_text(v), -1) for v in values], dtype=np.int32)

    def problems(self, rows: dict) -> np.ndarray:
        return self._problems_and_labels(rows)[0]

    def _problems_and_labels(self, rows: dict) -> tuple[np.ndarray, np.ndarray]:
        problems, y = super().problems(rows), self.label_indices(rows[self.options.label])
        problems[(problems == "") & (y < 0)] = text.UNKNOWN_LABEL
        return problems, y

    def encode(self, rows: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        problems, y = self._problems_and_labels(rows)
        texts = np.where(problems == "", rows[self.options.text_column], b"")
        x = text.hashed_ngrams(texts, self.options.buckets, self.options.max_length)
        return x, np.maximum(y, 0), problems

    def read_eval(self, path: str):
        columns = read_columns(path, [self.options.text_column, self.options.label])
        texts = _texts(columns[self.options.text_column])
        return _usable_eval(
            path, *self.encode({self.options.text_column: texts, self.options.label: columns[self.options.label]})
        )

    def evaluate(self, model, loss_fn, data) -> dict:
        x, y = data
        logits = np.concatenate([model(x[i : i + _EVAL_ROWS], training=False) for i in range(0, len(x), _EVAL_ROWS)])
        loss = float(np.mean(loss_fn(y, logits)))
        return {"loss": round(loss, 6), **text.classification_metrics(y, logits.argmax(axis=1), self.labels)}


class ByteLmTask(_TextTask):
    """A text's first --max-length bytes in, each next byte out; bits per byte and perplexity."""

    headline = "bits_per_byte"

    def __init__(self, options: TrainOptions, schema: dict):
        super().__init__(options, schema)
        self.names = [options.text_column]

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
        nats, count = 0.0, 0
        for i in range(0, len(x), _EVAL_ROWS):
            targets = y[i : i + _EVAL_ROWS]
            per_text = np.asarray(loss_fn(targets, model(x[i : i + _EVAL_ROWS], training=False)))
            lengths = (targets >= 0).sum(axis=1)
            nats, count = nats + float(np.dot(per_text, lengths)), count + int(lengths.sum())
        return text.byte_metrics(nats, count)


def label_text(value) -> str:
    """A label as the text --labels gives it: strings as they are, integers in decimal."""
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


def _usable_eval(path: str, x: np.ndarray, y: np.ndarray, problems: np.ndarray):
    usable = problems == ""
    if not usable.any():
        raise InputError(f"--eval-data {path}: no usable row ({dict(zip(*np.unique(problems, return_counts=True)))})")
    if not usable.all():
        reasons = {str(k): int(v) for k, v in zip(*np.unique(problems[~usable], return_counts=True))}
        log.warning("--eval-data %s: %d rows left out of the evaluation: %s", path, int((~usable).sum()), reasons)
    return x[usable], y[usable]


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


def prepare_task(options: TrainOptions, batches: Batches):
    """(task, skipped rows): the task of --model, its label set (given, or read from the batches with a
    warning), and every real row it cannot use, checked before any training step."""
    if options.model not in TEXT_MODELS:
        return NumericTask(options, batches.schema), Skipped()
    if options.model == "text-lm":
        task: _TextTask = ByteLmTask(options, batches.schema)
    else:
        labels = list(options.labels or ()) or _labels_in(options, batches)
        task = TextClassifierTask(options, batches.schema, labels)
    skipped = Skipped()
    for step, rows in step_batches(batches, [*task.names, "id", "weight"]):
        problems = task.problems(rows)
        bad = (rows["weight"] > 0) & (problems != "")
        if bad.any():
            skipped.add(step, rows["id"][bad], problems[bad])
    if len(skipped) and options.on_invalid == "error":
        counts = skipped.counts()["records"]
        raise InputError(
            f"{sum(counts.values())} records of the batches cannot be used by --model {options.model} "
            f"({', '.join(f'{k}: {v}' for k, v in counts.items())}):\n{skipped.examples()}\n"
            f"Fix them, or pass --on-invalid skip to train them with weight 0 (listed in OUTPUT/rejected/)"
        )
    return task, skipped


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
