"""What a model learns from a step's rows: a task turns batch features into model inputs and labels,
names the rows it cannot use, builds the model, and evaluates it on held-out records.

- `NumericTask`: fixed-shape features (one, or several by name) and a binary, multi-class or regression
  label (`logreg`, `mlp`, `module:function`, whose function gets a `ModelSchema`);
- `TextClassifierTask` (`text-classifier`): a text feature and a label among `--labels` (with
  --pretrained, also a frozen feature of the pretrained model's token embeddings);
- `ByteLmTask` (`text-lm`): a text feature, next-byte prediction;
- `CausalLmTask` (`causal-lm`): a text feature, next-token prediction by a pretrained model (--pretrained);
- `UserTask` (`--task module:function`, in `user_tasks`, with the user's models): the user's own.

`prepare_task` picks the task of the options and finds every row of the batches it cannot use
(`task_rows.Skipped`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np

from madp.core import storage
from madp.core.batch_files import USER_FEATURE, Feature
from madp.core.errors import InputError, OptionError
from madp.training import load_tensorflow, pretrained, text
from madp.training.batches import Batches
from madp.training.bpe_tokenizer import token_sequences
from madp.training.data import step_batches
from madp.training.options import TrainOptions, training_defaults
from madp.training.task_rows import (
    EVAL_ROWS,
    NUMPY_DTYPES,
    Skipped,
    eval_texts,
    finite_evaluation,
    read_columns,
    row_range,
    usable_eval,
)
from madp.training.user_tasks import TEXT_MODELS, ModelSchema, UserTask, user_model

tf = load_tensorflow()
import tf_keras  # noqa: E402

log = logging.getLogger("madp.train")


def _binary_logistic_loss(labels, logits):
    """Per-example loss of a one-logit binary classifier."""
    return tf.nn.sigmoid_cross_entropy_with_logits(
        labels=tf.cast(tf.reshape(labels, [-1]), tf.float32), logits=tf.reshape(logits, [-1])
    )


def build_model(name: str, input_dim: int, model_path: tuple[str, ...] = ()):
    """(Keras model, per-example loss) of `logreg`, `mlp`, or (a one-vector binary schema) module:function."""
    if name == "logreg":
        return tf_keras.Sequential([tf_keras.layers.Dense(1, input_shape=(input_dim,))]), _binary_logistic_loss
    if name == "mlp":
        return tf_keras.Sequential(
            [tf_keras.layers.Dense(64, activation="relu", input_shape=(input_dim,)), tf_keras.layers.Dense(1)]
        ), _binary_logistic_loss
    schema = ModelSchema((Feature("features", "float", (input_dim,)),), Feature("label", "float", ()), "binary")
    return user_model(name, schema, model_path)[:2]


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


class NumericTask:
    """Features in (one array, or a dict of them by name: --inputs), a label out (--task: binary 0/1,
    multiclass 0..N-1, regression); evaluation loss with accuracy, or mean squared and absolute error."""

    def __init__(self, options: TrainOptions, features: Mapping[str, Feature]):
        def feature(name: str, flag: str) -> Feature:
            found = features.get(name)
            if found is None or None in found.shape:
                raise InputError(
                    f"{flag} {name!r} must name a fixed-shape feature of the batches (found {sorted(features)})"
                )
            return found

        flag = "--inputs" if options.inputs else "--features"
        inputs = tuple(feature(name, flag) for name in options.input_features)
        self.schema = ModelSchema(inputs, feature(options.label, "--label"), options.task, options.classes)
        if options.model in ("logreg", "mlp") and (
            len(inputs) != 1 or len(inputs[0].shape) != 1 or options.task != "binary"
        ):
            raise OptionError("{model} {0} takes one vector feature and {task} binary", options.model)
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
        arrays = {f.name: np.asarray(columns[f.name], dtype=NUMPY_DTYPES[f.dtype]) for f in self.schema.inputs}
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
                raise OptionError("{eval_data} {0}: {1} rows: {2}", path, int(bad.sum()), problems[bad][0])
        return x, y

    def evaluate(self, model, loss_fn, data) -> dict:
        x, y = data
        rows = len(y)
        outputs = np.concatenate(
            [np.asarray(model(row_range(x, i, i + EVAL_ROWS), training=False)) for i in range(0, rows, EVAL_ROWS)]
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


class _TextTask:
    """Shared by the text tasks: the text feature must be a single string per row."""

    names: list[str]  # the batch features a step's rows need

    def __init__(self, options: TrainOptions, features: Mapping[str, Feature]):
        feature = features.get(options.text_column)
        if feature is None or feature.dtype != "bytes" or feature.shape != ():
            raise OptionError(
                "{text_column} {0!r} must name a text feature of the batches (one string per record; found {1})",
                options.text_column,
                sorted(features),
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

    def __init__(self, options: TrainOptions, features: Mapping[str, Feature], labels: list[str]):
        super().__init__(options, features)
        if options.label not in features:
            raise OptionError("{label} {0!r} is not a feature of the batches", options.label)
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
        return np.array([self.index.get(_label_text(v), -1) for v in values], dtype=np.int32)

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
        texts = eval_texts(columns[self.options.text_column])
        return usable_eval(
            path, *self.encode({self.options.text_column: texts, self.options.label: columns[self.options.label]})
        )

    def evaluate(self, model, loss_fn, data) -> dict:
        x, y = data
        logits = np.concatenate(
            [model(row_range(x, i, i + EVAL_ROWS), training=False) for i in range(0, len(y), EVAL_ROWS)]
        )
        loss = float(np.mean(loss_fn(y, logits)))
        return {"loss": round(loss, 6), **text.classification_metrics(y, logits.argmax(axis=1), self.labels)}


class ByteLmTask(_TextTask):
    """A text's first --max-length bytes in, each next byte out; bits per byte and perplexity."""

    headline = "bits_per_byte"

    def __init__(self, options: TrainOptions, features: Mapping[str, Feature]):
        super().__init__(options, features)
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
        texts = eval_texts(read_columns(path, [self.options.text_column])[self.options.text_column])
        return usable_eval(path, *self.encode({self.options.text_column: texts}))

    def evaluate(self, model, loss_fn, data) -> dict:
        x, y = data
        return text.byte_metrics(*text.summed_sequence_loss(model, loss_fn, x, y, EVAL_ROWS))


class CausalLmTask(_TextTask):
    """A pretrained causal LM (--pretrained: a GGUF file or a keras-hub preset directory) fine-tuned on
    a text's first --max-length tokens, with the model's own tokenizer: nothing of it is learned from
    the data. Loss and perplexity per token; `pretrained_eval` is the untrained model's, on the
    evaluation data."""

    headline = "perplexity"

    def __init__(self, options: TrainOptions, features: Mapping[str, Feature]):
        super().__init__(options, features)
        self.names = list(options.batch_features or ())
        self.pretrained = pretrained.read_pretrained(options.pretrained or "")
        context = self.pretrained.config.context_length
        if context is not None and options.max_length > context:  # RoPE positions it never saw
            raise OptionError(
                "{max_length} {0} exceeds the context length of {pretrained} ({1} tokens)", options.max_length, context
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
        texts = eval_texts(read_columns(path, [self.options.text_column])[self.options.text_column])
        data = usable_eval(path, *self.encode({self.options.text_column: texts}))
        if self.model is not None and self.pretrained_eval is None:  # the trainer reads it after build(),
            # before the first step (and before a --resume restores a checkpoint): the pretrained weights
            found = self.evaluate(self.model, pretrained.next_token_loss, data)
            what = f"--pretrained {self.options.pretrained}: the pretrained model's evaluation on --eval-data"
            self.pretrained_eval = finite_evaluation(found, what)
        return data

    def evaluate(self, model, loss_fn, data) -> dict:
        x, y = data
        return pretrained.mean_token_loss(model, x, y)


def _label_text(value) -> str:
    """A label as the text --labels gives it: strings as they are, integers in decimal."""
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


def step_features(task, batches: Batches) -> list[str]:
    """The batch features a training of `task` reads from each step: the task's, each row's `id` (the rows
    a task cannot use, --zero-out) and, on user-sampled batches, each row's user (clipped by user)."""
    return [*task.names, "id"] + ([USER_FEATURE] if batches.report.sampler == "users" else [])


def prepare_task(options: TrainOptions, batches: Batches):
    """(task, skipped rows): the task of --model, its label set (given, or read from the batches with a
    warning), and every real row it cannot use. Every step is read once, as the training reads it
    (`step_features`), before the training starts (so before its ledger entry): a row TensorFlow cannot
    parse as schema.json says (`data.step_batches` names its file) or a step of other than the rows the
    batch report records is refused here, not at the step that holds it."""
    task: _TextTask | NumericTask | UserTask
    if options.user_task:
        task = UserTask(options, batches.schema.features)
    elif options.model not in TEXT_MODELS:
        task = NumericTask(options, batches.schema.features)
    elif options.model == "text-lm":
        task = ByteLmTask(options, batches.schema.features)
    elif options.model == "causal-lm":
        task = CausalLmTask(options, batches.schema.features)
    else:
        labels = list(options.labels or ()) or _labels_in(options, batches)
        task = TextClassifierTask(options, batches.schema.features, labels)
    recorded = batches.report.rows_per_step
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


def _labels_in(options: TrainOptions, batches: Batches) -> list[str]:
    """The labels of the batches' usable rows, sorted; the released model discloses them."""
    found: set[str] = set()
    for _, rows in step_batches(batches, [options.text_column, options.label, "weight"]):
        usable = (rows["weight"] > 0) & (text.text_problems(rows[options.text_column]) == "")
        found.update(_label_text(v) for v in rows[options.label][usable])
    if not found:
        raise InputError(f"the batches hold no usable row with a label in {options.label!r}")
    labels = sorted(found)
    log.warning(
        "the label set was taken from the data (%s): the model and its metrics disclose it; "
        "give the public label set with --labels",
        ",".join(labels),
    )
    return labels
