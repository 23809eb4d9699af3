"""Reading `madp batch` outputs: the schema, the report, and one batch per materialized step."""
from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os

import numpy as np

from madp.records import InputError
from tf_training import load_tensorflow

tf = load_tensorflow()

_PARSE_ROWS = 8192


@dataclasses.dataclass(frozen=True)
class Batches:
    directory: str
    files: tuple[str, ...]
    schema: dict
    report: dict

    @property
    def steps(self) -> int:
        return int(self.report["steps"])

    @property
    def expected_batch_size(self) -> float:
        """The divisor of the noisy gradient sum: the target expected size, never the realized one."""
        return float(self.report["parameters"]["batch_size"])

    @property
    def max_rows_per_step(self) -> int:
        """Rows of the largest step in the files: B_max where steps are padded to it, else the largest batch."""
        return int(self.report["parameters"].get("max_batch_size") or self.report["written_batch_sizes"]["max"])

    def file_hashes(self) -> dict[str, str]:
        hashes = {}
        for path in self.files:
            digest = hashlib.sha256()
            with open(path, "rb") as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(block)
            hashes[os.path.basename(path)] = digest.hexdigest()
        return hashes


def open_batches(directory: str) -> Batches:
    files = tuple(sorted(glob.glob(os.path.join(directory, "batches-*.tfrecord"))))
    missing = [name for name in ("schema.json", "report.json") if not os.path.exists(os.path.join(directory, name))]
    if not files or missing:
        raise InputError(f"{directory}: not a `madp batch` output (needs batches-*.tfrecord, schema.json, report.json)")
    with open(os.path.join(directory, "schema.json")) as handle:
        schema = json.load(handle)
    with open(os.path.join(directory, "report.json")) as handle:
        report = json.load(handle)
    return Batches(directory, files, schema, report)


def feature_spec(schema: dict, names: list[str]) -> dict:
    """tf.io parsing spec of the named features (fixed shapes dense; varying lengths are refused)."""
    dtypes = {"int64": tf.int64, "float": tf.float32, "bytes": tf.string}
    spec = {}
    for name in names:
        if name not in schema["features"]:
            raise InputError(f"feature {name!r} is not in the batches (found {sorted(schema['features'])})")
        feature = schema["features"][name]
        if None in feature["shape"]:
            raise InputError(f"feature {name!r} has a varying length; the trainer needs fixed shapes")
        spec[name] = tf.io.FixedLenFeature(feature["shape"], dtypes[feature["dtype"]])
    return spec


def step_batches(batches: Batches, names: list[str]):
    """Yield (step, {feature: array}) for every step 0..T-1 in order, rows of a step together.

    Files hold rows in step order; rows are parsed in blocks and regrouped by step, so memory
    holds a block and one step, not the dataset. A step without rows yields empty arrays.
    """
    spec = feature_spec(batches.schema, sorted(set(names) | {"step", "weight"}))
    dataset = tf.data.TFRecordDataset(list(batches.files)).batch(_PARSE_ROWS).map(
        lambda serialized: tf.io.parse_example(serialized, spec), num_parallel_calls=tf.data.AUTOTUNE).prefetch(2)
    empty = {name: np.zeros((0, *feature.shape), feature.dtype.as_numpy_dtype) for name, feature in spec.items()}
    carry, next_step = empty, 0
    for block in dataset.as_numpy_iterator():
        block = {name: np.concatenate([carry[name], block[name]]) for name in spec}
        steps = block["step"]
        if np.any(np.diff(steps) < 0) or steps[0] < next_step or steps[-1] >= batches.steps:
            raise InputError(f"{batches.directory}: rows are not in step order 0..{batches.steps - 1}")
        last = int(steps[-1])  # its rows may continue in the next block
        starts = np.searchsorted(steps, np.arange(next_step, last + 1))
        for step, (lo, hi) in zip(range(next_step, last), zip(starts[:-1], starts[1:])):
            yield step, {name: values[lo:hi] for name, values in block.items()}
        carry, next_step = {name: values[starts[-1]:] for name, values in block.items()}, last
    for step in range(next_step, batches.steps):
        yield step, carry if step == next_step else empty
