"""What `madp train` checks and builds before its first step: the ids `--zero-out` zeroes, the devices
(`--distribution`), evaluation data declared public that is not, the checkpoint a `--resume` continues
from, the pretrained model taken as public, and the model with its loss and optimizer. The loop that
trains it and writes its outputs is `trainer.py`."""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from madp.core import storage
from madp.core.errors import InputError, OptionError
from madp.core.selection import read_selection_file, selection_files
from madp.training import (  # the public API, as the trainer uses it
    Batches,
    PrivacyPlan,
    compute_precision,
    labels_read_from_data,
    load_tensorflow,
    pretrained_is_public,
)
from madp.training.long_training import CheckpointState, interrupted_state, refuse_other_options
from madp.training.options import TrainOptions
from madp.training.outputs import INTERNAL_DIR, checkpoints_directory, replaced_kept
from madp.training.pretrained import check_pretrained_path
from madp.training.task_rows import read_columns
from madp.training.tasks import TextClassifierTask, default_optimizer, is_keras3

tf = load_tensorflow()
import tf_keras  # noqa: E402

log = logging.getLogger("madp.train")


def zero_out_ids(path: str) -> np.ndarray:
    """The record ids of a `--zero-out` file (a JSON list), as the batches' `id` feature holds them."""
    try:
        ids = json.loads(storage.read_text(path))
    except (OSError, ValueError) as error:
        raise OptionError("{zero_out} {0}: {1}", path, error) from error
    if not isinstance(ids, list) or not all(isinstance(i, (int, str)) and not isinstance(i, bool) for i in ids):
        raise OptionError("{zero_out} {0}: expected a JSON list of record ids (integers or strings)", path)
    if any(isinstance(i, str) for i in ids):  # string ids arrive from the TFRecords as bytes
        return np.array([str(i).encode() for i in ids], dtype=object)
    return np.array(ids, dtype=np.int64)


def distribution_strategy(options: TrainOptions):
    """The tf.distribute strategy of `--distribution`: default (one device), mirrored, or tpu."""
    if options.distribution == "default":
        return tf.distribute.get_strategy()
    if options.distribution == "mirrored":
        if options.cpu_replicas > 1:
            if tf.config.list_physical_devices("GPU"):
                raise OptionError(
                    "{cpu_replicas} splits the CPU of a machine without GPUs; mirrored uses the GPUs here"
                )
            cpu = tf.config.list_physical_devices("CPU")[0]
            try:
                tf.config.set_logical_device_configuration(
                    cpu, [tf.config.LogicalDeviceConfiguration()] * options.cpu_replicas
                )
            except RuntimeError:  # TensorFlow already started: only the same split can be used
                pass
            devices = [device.name for device in tf.config.list_logical_devices("CPU")]
            if len(devices) != options.cpu_replicas:
                raise OptionError(
                    "{cpu_replicas} {0}: TensorFlow already started with {1} CPU device(s) in this process; train "
                    "in a fresh process",
                    options.cpu_replicas,
                    len(devices),
                )
            return tf.distribute.MirroredStrategy(devices)
        return tf.distribute.MirroredStrategy()
    try:
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=options.tpu)
        tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
    except (ValueError, RuntimeError, tf.errors.OpError) as error:
        raise OptionError("{distribution} tpu: no TPU at {0!r} ({1})", options.tpu or "this machine", error) from error
    return tf.distribute.TPUStrategy(resolver)


def check_public_eval_data(path: str, batches: Batches) -> None:
    """--eval-data-public is the user's word that the evaluation data is public; refuse it where the data
    shows otherwise: a path that is, holds or lies inside the records the batches were made from or the
    bound selection, or a record id the bound selected (by the bound's id column, where the evaluation
    data has it). Evaluations on those are computed without noise on the trained users' records."""
    for role, source in (
        ("the records the batches were made from", batches.report.data),
        ("the bound selection", batches.report.selected),
    ):
        if source and storage.overlaps(path, source):
            raise OptionError(
                "{eval_data_public}: {eval_data} {0} overlaps {1} ({2}): evaluations on the trained records are "
                "not public; evaluate on public data, or leave {eval_data_public} out (the evaluations then go to "
                "OUTPUT/{3}/)",
                path,
                role,
                source,
                INTERNAL_DIR,
            )
    bound = batches.report.bound
    column = "id" if bound is None else bound.parameters.id_column
    ids = _column_if_present(path, column)
    if ids is None or not batches.report.selected:
        return
    try:
        shards = selection_files(batches.report.selected)
    except InputError as error:  # batches copied without their bound output: the paths are all it checks
        log.warning("--eval-data-public: the eval records' ids were not checked against the selection: %s", error)
        return
    candidates = None  # the eval ids, as the selection's type (the same in every shard)
    for shard in shards:
        selected, _ = read_selection_file(shard)
        if candidates is None:
            try:
                candidates = pa.array([i for i in ids if i is not None]).cast(selected.type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
                return  # ids of another type than the bound's: none is a selected record
        shared = candidates.filter(pc.is_in(candidates, value_set=selected))
        if len(shared):
            raise OptionError(
                "{eval_data_public}: {eval_data} {0} holds {1} record(s) the bound selected for training ({2} "
                "{3!r}, ...): evaluations on them are not public; leave {eval_data_public} out (the evaluations "
                "then go to OUTPUT/{4}/)",
                path,
                len(shared),
                column,
                shared[0].as_py(),
                INTERNAL_DIR,
            )


def _column_if_present(path: str, column: str) -> list | None:
    """Column `column` of an evaluation file, or None where it has no such column."""
    if path.endswith(".parquet") or storage.kind(path) == "directory":
        present = column in storage.parquet_columns(path)
    else:
        first = next((line for line in storage.read_text(path).splitlines() if line.strip()), "{}")
        try:
            row = json.loads(first)
        except ValueError as error:
            raise OptionError("{eval_data} {0}: its first line is not a JSON object ({1})", path, error) from error
        present = isinstance(row, dict) and column in row
    return read_columns(path, [column])[column] if present else None


def resume_point(batches_dir: str, output: str, options: TrainOptions) -> CheckpointState | None:
    """The checkpoint state a --resume continues from (its step and the interrupted training's id in the
    trainings ledger), once its options are those of the interrupted training
    (`refuse_other_options`); None for a fresh run. A fresh run into an output holding a checkpoint is
    refused, and so is one into an output holding another training's logs unless --replace. Reads only."""
    state = interrupted_state(output, batches_dir)
    if not options.resume:
        checkpoints = checkpoints_directory(output)
        if state is not None or (options.replace and storage.kind(checkpoints) != "missing"):
            kept = replaced_kept(output)
            raise OptionError(
                "{0} holds a checkpoint of an interrupted training ({1}): pass {resume} to finish it (madp run: "
                "train.resume: true), or move it away to train afresh (a new training would compose with it: the "
                "trainings ledger holds it since its first noisy update){2}",
                output,
                checkpoints,
                "; " * bool(kept) + kept,
            )
        if storage.kind(storage.join(output, "logs")) != "missing" and not options.replace:
            raise OptionError(
                "{0} holds the logs of an earlier training (published with its model): train into a new OUTPUT, so "
                "that no folder mixes two trainings' figures, or replace that training ({replace})",
                output,
            )
        return None
    if state is None:
        raise OptionError("{resume}: {0} holds no checkpoint (train with {checkpoint_every} N)", output)
    refuse_other_options(output, state, options)
    return state


def public_model_assumption(options: TrainOptions) -> str | None:
    """The assumption that --pretrained is public, naming its files by their digest (None without a
    pretrained model or without privacy). The model is named before it is read and checked after
    (`with_public_inputs`): a file swapped meanwhile would be named but not the one trained from. The
    path is checked first, so that one which holds no model is refused before all its files are hashed."""
    if options.pretrained is None or options.mechanism == "none":
        return None
    check_pretrained_path(options.pretrained)
    return pretrained_is_public(options.pretrained)


def with_public_inputs(privacy: PrivacyPlan, task, options: TrainOptions, public_model: str | None) -> PrivacyPlan:
    """The plan with the assumptions its guarantee rests on beyond the batches: a text classifier's label
    set read from the data (refused where the mechanism relies on the secret sampling), and the pretrained
    model taken as public (its files' digest, refused where they changed while madp read them)."""
    if isinstance(task, TextClassifierTask) and not options.labels:
        if privacy.relies_on_secret_sampling:  # a label only unsampled records hold would be missing
            raise OptionError(
                "{0} relies on the secret sampling, and a label set read from the sampled rows would reveal which "
                "records were sampled: give the public label set with {labels}",
                privacy.mechanism,
            )
        privacy = dataclasses.replace(privacy, assumptions=(*privacy.assumptions, labels_read_from_data(task.labels)))
    if options.pretrained is not None and public_model is not None:
        if pretrained_is_public(options.pretrained) != public_model:
            raise OptionError(
                "{pretrained} {0}: its files changed while madp read them; train again from files that stay as they "
                "are",
                options.pretrained,
            )
        privacy = dataclasses.replace(privacy, assumptions=(*privacy.assumptions, public_model))
    return privacy


class Built(NamedTuple):
    """The model a training trains, built under its distribution strategy, with its per-row loss and its
    optimizer; `own_optimizer` is the one a module:function model brought (else None)."""

    model: Any
    loss_fn: Any
    optimizer: Any
    own_optimizer: Any


def build_model_and_optimizer(task, strategy, options: TrainOptions) -> Built:
    """The task's model and loss, and the optimizer (a module:function model's own, else --optimizer's, of
    the model's Keras), built under the strategy from --seed, at --mixed-precision's compute precision."""
    replicas = strategy.num_replicas_in_sync
    tf_keras.utils.set_random_seed(options.seed)
    with strategy.scope(), compute_precision(options.mixed_precision):
        model, loss_fn = task.build()
        if is_keras3(model) and replicas > 1:  # its optimizer would need Keras 3's own distribution
            raise OptionError("{model} {0} is a Keras 3 model: train it with {distribution} default", options.model)
        # A module:function model may bring its optimizer; else --optimizer, of the model's Keras.
        own_optimizer = getattr(task, "optimizer", None)
        optimizer = own_optimizer or default_optimizer(model, options)
    if own_optimizer is not None:
        _refuse_optimizer_flags(options)
    return Built(model, loss_fn, optimizer, own_optimizer)


def _refuse_optimizer_flags(options: TrainOptions) -> None:
    """The options that build madp's optimizer would be silently ignored by a model that brings its own."""
    given = [
        f"{{{name}}}"
        for name in ("optimizer", "learning_rate", "adam_epsilon", "lr_schedule")
        if getattr(options, name) is not None
    ]
    if given:
        raise OptionError(
            f"{', '.join(given)}: this model brings its own optimizer, which these would not change: drop them, "
            "or return (model, loss) without an optimizer"
        )
