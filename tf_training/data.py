"""Reading `madp batch` outputs: the schema, the report, and one batch per materialized step."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from madp.core import storage
from madp.core.batch_files import BatchSchema, read_batch_report
from madp.core.errors import InputError, one_line
from madp.training import load_tensorflow
from madp.training.batches import READER, Batches, open_batches, unchanged

tf = load_tensorflow()

_PARSE_ROWS = 8192


def feature_spec(schema: BatchSchema, names: list[str]) -> dict:
    """tf.io parsing spec of the named features (fixed shapes dense; varying lengths are refused)."""
    dtypes = {"int64": tf.int64, "float": tf.float32, "bytes": tf.string}
    spec = {}
    for name in names:
        feature = schema.features.get(name)
        if feature is None:
            raise InputError(f"feature {name!r} is not in the batches (found {sorted(schema.features)})")
        if None in feature.shape:
            raise InputError(f"feature {name!r} has a varying length; the trainer needs fixed shapes")
        spec[name] = tf.io.FixedLenFeature(list(feature.shape), dtypes[feature.dtype])
    return spec


def step_batches(batches: Batches, names: list[str]):
    """Yield (step, {feature: array}) for every step 0..T-1 in order, rows of a step together.

    Files hold rows in step order; rows are parsed in blocks and regrouped by step, so memory
    holds a block and one step, not the dataset. A step without rows yields empty arrays. The files are
    read under a reader's mark on their folder, which refuses a `madp batch` of another process into it
    until the last step is read (or the iteration is closed), and only if they are still those of the
    report they were opened with: a training never reads a mix of two batchings.
    """
    with storage.reading(batches.directory, READER):
        unchanged(batches)
        yield from _steps(batches, names)


def _steps(batches: Batches, names: list[str]):
    spec = feature_spec(batches.schema, sorted(set(names) | {"step", "weight"}))
    empty = {name: np.zeros((0, *feature.shape), feature.dtype.as_numpy_dtype) for name, feature in spec.items()}
    carry, next_step = empty, 0
    for path in batches.files:
        for block in _parsed_blocks(path, spec):
            block = {name: np.concatenate([carry[name], block[name]]) for name in spec}
            steps = block["step"]
            if np.any(np.diff(steps) < 0) or steps[0] < next_step or steps[-1] >= batches.steps:
                raise InputError(f"{batches.directory}: rows are not in step order 0..{batches.steps - 1}")
            last = int(steps[-1])  # its rows may continue in the next block
            starts = np.searchsorted(steps, np.arange(next_step, last + 1))
            for step, (lo, hi) in zip(range(next_step, last), zip(starts[:-1], starts[1:])):
                yield step, {name: values[lo:hi] for name, values in block.items()}
            carry, next_step = {name: values[starts[-1] :] for name, values in block.items()}, last
    for step in range(next_step, batches.steps):
        yield step, carry if step == next_step else empty


def _parsed_blocks(path: str, spec: dict):
    """The rows of one batch file, parsed in blocks of `_PARSE_ROWS`; a row TensorFlow cannot parse as the
    schema says (a feature missing, of another type or length) is an InputError naming the file. `madp
    train` parses every step before its first (`tasks.prepare_task`), so it refuses such a file before it
    trains; a loop of the Python API meets it at the step that holds it."""
    blocks = (
        tf.data.TFRecordDataset([path])
        .batch(_PARSE_ROWS)
        .map(lambda serialized: tf.io.parse_example(serialized, spec), num_parallel_calls=tf.data.AUTOTUNE)
        .prefetch(2)
        .as_numpy_iterator()
    )
    while True:
        try:
            block = next(blocks)
        except StopIteration:
            return
        except tf.errors.OpError as error:
            raise InputError(
                f"{path}: TensorFlow cannot read its rows as schema.json describes them ({one_line(error)}): not "
                f"the file madp batch wrote; batch again"
            ) from None
        yield block


class StepRows(NamedTuple):
    """What each step of a batch output holds: its `rows`, padding rows included, and its `records`, the
    real ones (weight 1.0; padding rows weigh 0.0)."""

    rows: np.ndarray
    records: np.ndarray


def rows_per_step(directory: str) -> StepRows:
    """The rows and the records each step of the batches in `directory` holds, as their report records
    them (`BatchReport.rows_per_step`, `written_batch_sizes`); counted in the files where a report of madp
    before it recorded them does not say."""
    report = read_batch_report(directory)
    rows, records = report.rows_per_step, report.written_batch_sizes.per_step
    if rows is None or records is None:
        steps = [
            (len(step["step"]), int(np.count_nonzero(step["weight"])))
            for _, step in step_batches(open_batches(directory), [])
        ]
        rows, records = [held for held, _ in steps], tuple(real for _, real in steps)
    return StepRows(np.asarray(rows, dtype=np.int64), np.asarray(records, dtype=np.int64))
