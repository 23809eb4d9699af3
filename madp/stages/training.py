"""The training step: a model trained with DP-SGD or DP-BandMF on a batch output, under its privacy plan."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from madp.stages.arguments import options_of, writing
from madp.training.options import TrainOptions

if TYPE_CHECKING:  # madp.training.outputs is light, but the result comes from the trainer, which imports TensorFlow
    from madp.training.outputs import TrainingResult


def train(batches: str, output: str, batches_copy: BatchesCopy | None = None, **options: Any) -> TrainingResult:
    """Train a model on the batches, privately (DP-SGD or DP-BandMF) unless mechanism is "none".

    The step `madp train` runs, with `output` held (its lock) while it is written: OUTPUT/model.keras,
    metrics.json and privacy.json (the plan and whether the model holds it). A private training enters
    the trainings ledger of the batches' selection, so that a later one on the same selection composes
    with it. TensorFlow is imported on the first call.

    Args:
        batches: a `madp.batch` output directory.
        output: the directory to write.
        **options: the options of `madp train` by their snake_case names, the fields of
            `madp.training.options.TrainOptions`: epsilon or noise_multiplier (or calibration, a
            calibration.json of `madp.calibrate`), delta, mechanism, bands, model ("logreg", "mlp",
            "text-classifier", "text-lm", "causal-lm", or "module:function"), learning_rate, clip_norm,
            seed (the model's initialization), noise_seed (TESTING ONLY: not private), eval_data, ...

    Returns:
        The training's result, a `madp.training.outputs.TrainingResult` (frozen; `to_json()` is what
        `madp train` prints): `metrics` (metrics.json: the settings it ran with, and the evaluations where
        eval_data_public), `privacy` (privacy.json: the plan's mechanism, epsilon, delta, noise multiplier,
        ...), `wall_time_s`, `steps_per_s`.

    Raises:
        TypeError: an option that `madp train` does not have (the error lists those it has).
        madp.core.errors.InputError: bad options or batches, a training the ledger refuses (an earlier
            private training on these batches without retrain), an output that overlaps an input or
            that another madp process is writing, TensorFlow missing; the message names the option or
            file.

    Example:
        >>> import json, madp, tempfile
        >>> from madp.tools.data.synthetic import GraphSpec, generate, write_dataset
        >>> work, spec = tempfile.mkdtemp(), GraphSpec(records=400, seed=1)
        >>> _ = write_dataset(generate(spec), spec, f"{work}/records.parquet", shards=1)
        >>> _ = madp.bound(f"{work}/records.parquet", f"{work}/bounded", max_contributions=3)
        >>> _ = madp.batch(f"{work}/bounded", f"{work}/records.parquet", f"{work}/batches", steps=12,
        ...                batch_size=8, min_sep=2, seed=0)  # seed: reproducible, NOT private
        >>> result = madp.train(f"{work}/batches", f"{work}/model", epsilon=8, bands=2, eval_every=12)
        >>> result.privacy == json.load(open(f"{work}/model/privacy.json"))
        True
        >>> result.privacy["mechanism"], result.privacy["epsilon"] <= 8, result.privacy["noise"]
        ('bandmf', True, 'secret key (fresh entropy, never written)')
        >>> result.metrics.settings["steps"], result.metrics.settings["model"]
        (12, 'logreg')
    """
    train_options = options_of("train", TrainOptions, options)
    paths = (train_options.eval_data, train_options.calibration, train_options.zero_out, train_options.pretrained)
    with writing(output, (batches, *paths), "train"):
        return run_train(batches, output, train_options, batches_copy or BatchesCopy())


@dataclasses.dataclass(frozen=True)
class BatchesCopy:
    """Where batches at a URL (gs://, s3://, hdfs://: TensorFlow reads none of them) are copied before the
    training, and the Beam pipeline options their file system is set up with (`--hdfs_host`, ...)."""

    folder: str | None = None  # None: a folder per URL in the user's cache (`remote_batches.default_copy_folder`)
    file_system_options: tuple[str, ...] = ()


def run_train(batches: str, output: str, options: TrainOptions, copy: BatchesCopy = BatchesCopy()) -> TrainingResult:
    """`train` with its options built (`madp train` builds them from its arguments), on an output its
    caller holds. Batches at a URL are copied to a local folder first (`local_batches`), and the training
    reads the copy."""
    from madp.training.trainer import train as train_model

    return train_model(local_batches(batches, copy), output, options)


def local_batches(batches: str, copy: BatchesCopy) -> str:
    """The batches as a local folder: `batches` itself, or for a URL its copy, made through Beam's file
    systems and checked against the batch report (`madp.beam.remote_batches.copy_batches`). `madp train` and
    `madp run` take the folder and the options from the environment (`remote_batches.FOLDER_VARIABLE`,
    `OPTIONS_VARIABLE`), as their options are the training's own."""
    if "://" not in batches:
        return batches
    from madp.beam.remote_batches import copy_batches, default_copy_folder, environment_options  # Beam only here

    folder = copy.folder or default_copy_folder(batches)
    return copy_batches(batches, folder, copy.file_system_options or environment_options())
