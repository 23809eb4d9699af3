"""The rows a task reads and the rows a model cannot use: evaluation files' columns as the batches
hold them (`read_columns`, `eval_texts`), a model run a few rows at a time (`EVAL_ROWS`,
`row_range`), the batches' rows a task cannot use, trained with weight 0 (`Skipped`), the evaluation
rows it cannot use, left out (`usable_eval`), and a model that computes no number on its rows or in
its evaluation (`NotFinite`: `refuse_non_finite_loss`, `finite_evaluation`)."""

from __future__ import annotations

import collections
import json
import logging
import math

import numpy as np

from madp.core import storage
from madp.core.errors import InputError, OptionError
from madp.training import load_tensorflow
from madp.training.options import TrainOptions

tf = load_tensorflow()

log = logging.getLogger("madp.train")
EVAL_ROWS = 512


def read_columns(path: str, names: list[str]) -> dict[str, list]:
    """Columns `names` of a .jsonl or Parquet evaluation file (or directory of Parquet files)."""
    if path.endswith(".parquet") or storage.kind(path) == "directory":
        table = storage.read_parquet(path, names)
        return {name: table.column(name).to_pylist() for name in names}
    rows = [json.loads(line) for line in storage.read_text(path).splitlines() if line.strip()]
    missing = [name for name in names if rows and name not in rows[0]]
    if missing:
        raise OptionError("{eval_data} {0}: no column {1} (found {2})", path, missing, sorted(rows[0]))
    return {name: [row.get(name) for row in rows] for name in names}


def eval_texts(values: list) -> np.ndarray:
    """Evaluation text values as UTF-8 bytes (None stays None, so it is reported as empty)."""
    out = np.empty(len(values), dtype=object)
    for row, value in enumerate(values):
        try:
            out[row] = value.encode("utf-8") if isinstance(value, str) else (value or b"")
        except UnicodeEncodeError:  # lone surrogates in JSON text
            out[row] = b"\xff"
    return out


NUMPY_DTYPES = {"float": np.float32, "int64": np.int64, "bytes": object}


def row_range(x, start: int, stop: int):
    """Rows start..stop of an input array, or of each array of a dict of inputs."""
    return tf.nest.map_structure(lambda a: a[start:stop], x)


def usable_eval(path: str, x, y: np.ndarray, problems: np.ndarray):
    usable = problems == ""
    if not usable.any():
        raise OptionError(
            "{eval_data} {0}: no usable row ({1})", path, dict(zip(*np.unique(problems, return_counts=True)))
        )
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


class NotFinite(InputError):
    """The model computes no number: an evaluation, its loss on a step's rows or its weights are NaN or
    infinite. A checkpoint of it would stop a resume at the same place (`trainer._settled` removes it)."""


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
            np.atleast_1d(loss_fn(y[i : i + EVAL_ROWS], model(row_range(x, i, i + EVAL_ROWS), training=False)))
            for i in range(0, len(y), EVAL_ROWS)
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
