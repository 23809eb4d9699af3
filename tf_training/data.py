"""Reading `madp batch` outputs: the schema, the report, and one batch per materialized step; the public API's
`read_steps` and `steps_dataset` (as a tf.data.Dataset) give them in step order."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np

from madp.core import output_lock
from madp.core.batch_files import BatchSchema, read_batch_report
from madp.core.errors import InputError, one_line
from madp.training import load_tensorflow
from madp.training.batches import READER, Batches, open_batches, unchanged

tf = load_tensorflow()

_PARSE_ROWS = 8192


def _feature_spec(schema: BatchSchema, names: list[str]) -> dict:
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
    with output_lock.reading(batches.directory, READER):
        unchanged(batches)
        yield from _steps(batches, names)


def _steps(batches: Batches, names: list[str]):
    spec = _feature_spec(batches.schema, sorted(set(names) | {"step", "weight"}))
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


def read_steps(batches: Batches, features: Sequence[str]) -> Iterator[dict[str, np.ndarray]]:
    """The rows of every step, steps 0..T-1 in order, a step's rows together.

    Train on every step, an empty one (arrays of no rows) too: its noise is part of the mechanism. Rows
    are parsed in blocks, so memory holds a block and one step. The files are read under a reader's mark
    on their folder, which keeps a `madp batch` of another process out until the last step is read.

    Args:
        batches: the batches (`open_batches`).
        features: the columns to read (schema.json's names, e.g. "features" and "label").

    Returns:
        An iterator of one dict of arrays per step (one entry per row) holding `features`, `weight` (1
        for a sampled record, 0 for a padding row, whose gradient is then zero) and `step` (each row's
        step, padding rows' too, which a private step checks: hand it over as `index`).

    Raises:
        madp.core.errors.InputError: a feature that is not in the batches or varies in length, batches
            rewritten since they were opened, or a file whose rows are not the schema's or not in step
            order; the message names the feature or file.

    Example:
        >>> import madp, tempfile
        >>> from madp.tools.data.synthetic import GraphSpec, generate, write_dataset
        >>> work, spec = tempfile.mkdtemp(), GraphSpec(records=400, features=4, seed=1)
        >>> _ = write_dataset(generate(spec), spec, f"{work}/records.parquet", shards=1)
        >>> _ = madp.bound(f"{work}/records.parquet", f"{work}/bounded", max_contributions=3)
        >>> _ = madp.batch(f"{work}/bounded", f"{work}/records.parquet", f"{work}/batches", steps=12,
        ...                batch_size=8, min_sep=2, seed=0)  # seed: reproducible, NOT private
        >>> from madp.training import open_batches, read_steps
        >>> steps = list(read_steps(open_batches(f"{work}/batches"), ["features", "label"]))
        >>> len(steps), sorted(steps[0]), steps[0]["features"].shape
        (12, ['features', 'label', 'step', 'weight'], (5, 4))
        >>> [len(rows["step"]) for rows in steps]  # each step's rows: its sampled records
        [5, 7, 6, 16, 9, 8, 11, 6, 9, 6, 9, 4]

    With a private step (`make_private`), each step's rows in one call::

        for rows in read_steps(batches, ["features", "label"]):
            step(rows["features"], rows["label"], rows["weight"], index=rows["step"])
    """
    for _, rows in step_batches(batches, list(features)):
        yield rows


def steps_dataset(batches: Batches, features: Sequence[str]):
    """`read_steps` as a `tf.data.Dataset`: one element per step, steps 0..T-1 in order.

    Take every element once, in order, whole: no shuffle, filter, repeat, or unbatch and batch again (the
    plan accounts for each step's rows once, an empty step too); hand its `step` to the step as its
    `index`, which refuses rows of any step but its next, of several, and other than all of the step's
    rows. Continuing a training after step k: `.skip(k)`.

    Args:
        batches: the batches (`open_batches`).
        features: the columns to read (schema.json's names, e.g. "features" and "label").

    Returns:
        A `tf.data.Dataset` whose elements are dicts of tensors `[the step's rows, *the feature's shape]`
        holding `features`, `weight` and `step`.

    Raises:
        madp.core.errors.InputError: a feature that is not in the batches or varies in length (here); as
            the dataset is iterated, what `read_steps` raises.

    Example:
        >>> import madp, tempfile
        >>> from madp.tools.data.synthetic import GraphSpec, generate, write_dataset
        >>> work, spec = tempfile.mkdtemp(), GraphSpec(records=400, features=4, seed=1)
        >>> _ = write_dataset(generate(spec), spec, f"{work}/records.parquet", shards=1)
        >>> _ = madp.bound(f"{work}/records.parquet", f"{work}/bounded", max_contributions=3)
        >>> _ = madp.batch(f"{work}/bounded", f"{work}/records.parquet", f"{work}/batches", steps=12,
        ...                batch_size=8, min_sep=2, seed=0)  # seed: reproducible, NOT private
        >>> from madp.training import open_batches, steps_dataset
        >>> dataset = steps_dataset(open_batches(f"{work}/batches"), ["features", "label"])
        >>> first = next(iter(dataset))
        >>> {name: tuple(tensor.shape) for name, tensor in sorted(first.items())}
        {'features': (5, 4), 'label': (5,), 'step': (5,), 'weight': (5,)}
        >>> len(list(dataset.skip(10)))  # continuing after step 10
        2

    With a private step (`make_private`)::

        for rows in steps_dataset(batches, ["features", "label"]):
            step(rows["features"], rows["label"], rows["weight"], index=rows["step"])
    """
    spec = _feature_spec(batches.schema, sorted(set(features) | {"step", "weight"}))
    signature = {name: tf.TensorSpec([None, *feature.shape], feature.dtype) for name, feature in spec.items()}

    def steps():
        for _, rows in step_batches(batches, list(features)):
            yield rows

    return tf.data.Dataset.from_generator(steps, output_signature=signature)
