"""The training step: a model trained with DP-SGD or DP-BandMF on a batch output, under its privacy plan."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from madp.stages.arguments import options_of, writing
from madp.training.options import TrainOptions

if TYPE_CHECKING:  # madp.training.outputs is light, but the result comes from the trainer, which imports TensorFlow
    from madp.training.outputs import TrainingResult


def train(batches: str, output: str, **options: Any) -> TrainingResult:
    """Train a model on the batches, privately (DP-SGD or DP-BandMF) unless mechanism is "none".

    The step `madp train` runs, with `output` held (its lock) while it is written: OUTPUT/model.keras,
    metrics.json and privacy.json (the plan and whether the model holds it). A private training enters
    the trainings ledger of the batches' selection, so that a later one on the same selection composes
    with it. TensorFlow is imported on the first call.

    Args:
        batches: a `madp.batch` output directory, or its URL (gs://, s3://, hdfs://: copied to the local
            folder batches_copy first, through the file system that file_system_options set up).
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
    with writing(output, (batches, *train_options.paths_beside_batches), "train"):
        return run_train(batches, output, train_options)


def run_train(batches: str, output: str, options: TrainOptions) -> TrainingResult:
    """`train` with its options built (`madp train` builds them from its arguments), on an output its
    caller holds. Batches at a URL are copied to a local folder first (`local_batches`), and the training
    reads the copy."""
    from madp.training.trainer import train as train_model

    return train_model(local_batches(batches, options), output, options)


def local_batches(batches: str, options: TrainOptions) -> str:
    """The batches as a local folder: `batches` itself, or for a URL its copy in --batches-copy, made through
    Beam's file systems set up with --file-system-options and checked against the batch report
    (`madp.beam.remote_batches.copy_batches`)."""
    if "://" not in batches:
        return batches
    from madp.beam.remote_batches import copy_batches, default_copy_folder  # Beam only here

    folder = options.batches_copy or default_copy_folder(batches)
    return copy_batches(batches, folder, options.file_system_options)
