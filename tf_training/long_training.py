"""What a long `madp train` job needs: TensorBoard scalars (published and internal, stamped with steps
rather than clock times: `ScalarLog`), learning-rate schedules, and checkpoints a job resumes from.

Published vs internal, as everywhere in madp: only what the guarantee covers, or what is a function of
public parameters, may be published. `epsilon_spent` is a function of the plan alone (public), so it
goes to OUTPUT/logs/ (beside the evaluation scalars, where the evaluation data is declared public).
The training loss, the clipped fraction and the gradient norms are computed from the training rows
without noise, so one user's records can move them: they go to OUTPUT/internal/ only. So do the
checkpoints, which hold BandMF's last noise vectors (with them and two consecutive models one could
strip the noise off a step's gradient sum).
"""

from __future__ import annotations

import dataclasses
import json
import math
import posixpath
from collections.abc import Callable
from typing import Any

import numpy as np

from madp.accounting.calibrate import epsilon
from madp.accounting.mechanisms import BandMf
from madp.core import storage
from madp.core.errors import InputError, OptionError
from madp.core.options import error_text
from madp.training import load_tensorflow
from madp.training.clipping import user_averages
from madp.training.ledger import FINISHED, entry_of, ledger_of
from madp.training.options import TrainOptions, training_defaults
from madp.training.outputs import (
    CHECKPOINTS,
    NEXT_STATE_FILE,
    STATE_FILE,
    checkpoints_directory,
    internal_path,
    replaced_kept,
)
from madp.training.plan import PrivacyPlan
from madp.training.steps import row_groups

tf = load_tensorflow()


# --- learning rate ------------------------------------------------------------------------------


def learning_rate_at(step: int, steps: int, options: TrainOptions) -> float:
    """The learning rate of step `step` (0-based) of `steps` (--lr-schedule, or the model's default
    schedule: `training_defaults`): constant; cosine decay
    from --learning-rate to 0; or a linear warmup over --warmup-steps to it, then cosine decay over the
    rest. A function of public settings and the step index only."""
    settings = training_defaults(options)
    base, schedule = settings.learning_rate, settings.lr_schedule
    if schedule == "constant":
        return base
    warmup = options.warmup_steps if schedule == "warmup-cosine" else 0
    if step < warmup:
        return base * (step + 1) / warmup
    span = max(steps - warmup, 1)
    return base * 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / span))


def set_learning_rate(optimizer, value: float) -> None:
    """Assign the optimizer's learning-rate variable (tf_keras and Keras 3 both hold one; the step's
    tf.function reads it, so no retrace)."""
    optimizer.learning_rate.assign(value)


# --- scalars ------------------------------------------------------------------------------------

_SCALAR = tf.compat.v1.SummaryMetadata(plugin_data=tf.compat.v1.SummaryMetadata.PluginData(plugin_name="scalars"))


def _events_file_name(first_step: int) -> str:
    """The name of the event file of a training that starts after step `first_step` (0, or the step a
    --resume continues from): TensorBoard reads any name holding "tfevents", and the files of a resumed
    training sort after the ones before it."""
    return f"events.out.tfevents.{first_step:010d}.madp"


class ScalarLog:
    """TensorBoard scalars in an event file of madp's own, with no clock time anywhere: every event's
    wall_time is its step, and the file is named by the step it starts at (`_events_file_name`).

    tf.summary's writer stamps each event with the time it was written (to the microsecond) and names
    its file by the time it started, the host and the process id. Published beside the model, those
    times would say how long each step took, which depends on how many rows the secret sampling drew
    and on the sampled records' content. The file is TensorBoard's format (TFRecords of Event protos,
    each scalar a float32 tensor of the "scalars" plugin, as tf.summary.scalar writes it), flushed after
    every event, so TensorBoard follows a running training and an interruption loses nothing written."""

    def __init__(self, directory: str, first_step: int = 0) -> None:
        tf.io.gfile.makedirs(directory)
        self._file = tf.io.TFRecordWriter(storage.join(directory, _events_file_name(first_step)))
        self._write(tf.compat.v1.Event(wall_time=float(first_step), file_version="brain.Event:2"))

    def scalar(self, tag: str, value: float, step: int) -> None:
        tensor = tf.make_tensor_proto(np.float32(value))
        summary = tf.compat.v1.Summary(value=[tf.compat.v1.Summary.Value(tag=tag, tensor=tensor, metadata=_SCALAR)])
        self._write(tf.compat.v1.Event(wall_time=float(step), step=step, summary=summary))

    def _write(self, event) -> None:
        self._file.write(event.SerializeToString())
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def epsilon_spent(plan: PrivacyPlan, steps: int) -> float:
    """The epsilon of the first `steps` steps alone, at the plan's sigma and at the delta the plan gives
    its mechanism (`plan.delta` less the truncation share), so that it pairs with `plan.delta`: the
    truncation share of fewer steps at a smaller epsilon is no larger. The plan's mechanism accounted
    for `steps` steps (PLD on a 10x coarser grid, still an upper bound). Public: a function of the
    plan only. A Monte Carlo plan (bandmf-minsep) is accounted by its formal,
    unamplified fallback (`formal_mechanism`); a composition with earlier trainings is not included."""
    mechanism = plan.formal_mechanism
    if isinstance(mechanism, BandMf):  # fewer steps: fewer participations fit at this min-sep
        most = 1 + (steps - 1) // mechanism.min_sep
        mechanism = dataclasses.replace(
            mechanism, steps=steps, max_participations=min(mechanism.max_participations, most)
        )
    else:
        mechanism = dataclasses.replace(mechanism, steps=steps)
    return epsilon(mechanism, plan.noise_multiplier, plan.delta - plan.truncation_delta, discretization=1e-2)


def step_statistics(model, loss_fn, x, y, weight: np.ndarray, users: np.ndarray | None, clip_norm: float) -> dict:
    """INTERNAL diagnostics of one step's rows, before its update: the mean weighted loss, and over the
    step's records (users, for user-level clipping) with weight the mean per-example gradient norm and
    the fraction above `clip_norm`. No noise: never publish them. The model runs in inference mode, so
    computing them draws no randomness (dropout) and leaves the training itself unchanged."""
    if not len(weight):  # an empty step: nothing to measure
        return {"loss": 0.0, "gradient_norm_mean": 0.0, "clipped_fraction": 0.0}
    w = tf.constant(weight, tf.float32)

    def one(example):
        xi, yi, wi = example
        with tf.GradientTape() as tape:
            loss = loss_fn(yi[None], model(tf.nest.map_structure(lambda t: t[None], xi), training=False))[0] * wi
        return loss, tape.gradient(loss, model.trainable_variables)

    losses, gradients = tf.vectorized_map(one, (x, tf.constant(y), w))
    if users is not None:  # the record of a user: the average gradient of its rows, as the step clips it
        gradients, totals = user_averages(gradients, w, row_groups(users, len(weight)))
        present = totals.numpy() > 0
    else:
        present = weight > 0
    squares = sum(tf.reduce_sum(tf.reshape(tf.square(g), [tf.shape(g)[0], -1]), axis=1) for g in gradients)
    norms = np.sqrt(np.asarray(squares))[present]
    total = float(weight.sum())
    return {
        "loss": float(tf.reduce_sum(losses)) / total if total else 0.0,
        "gradient_norm_mean": float(norms.mean()) if len(norms) else 0.0,
        "clipped_fraction": float((norms > clip_norm).mean()) if len(norms) else 0.0,
    }


# --- checkpoints --------------------------------------------------------------------------------


class Checkpoints:
    """OUTPUT/internal/checkpoints/: model, optimizer, the step reached and, for a private step, the
    query's step counter and BandMF's noise history - never the noise key (`_state.key` is left out).
    state.json beside them holds the step, the evaluations so far, the (public) plan and the options
    that define the training (`_training_options`), which a resume must match, and the training's id
    in the trainings ledger, whose entry a resume continues.

    Why a resumed private run keeps the guarantee: steps 0..k-1 ran with key K1, the remaining steps
    draw z_t from a fresh key K2 (keyed by (K2, t)), so every z_t is still an independent N(0, sigma^2)
    draw and none is reused; BandMF's w_t = (z_t - sum c_j w_{t-j}) / c_0 continues from the restored
    history, so the noise is C^-1 z as accounted. Steps the interrupted run computed after its last
    checkpoint are re-done with other noise, which is safe only because nothing from them was released:
    every evaluation (the published scalars) is preceded by a checkpoint at the same step.

    A checkpoint is written in three steps: its files and `next_state.json` (the state it completes), the
    ledger entry moved to its step (`step.checkpointed()`: no continuation from an earlier step from then
    on), then state.json. A crash before the ledger's write resumes from the checkpoint before, which the
    ledger still accepts; one after it resumes from this one, which the ledger already names (`interrupted_state`).
    The other order let a crash between them leave state.json ahead of the ledger, so that a copy of an
    older checkpoint could continue beside this one."""

    def __init__(self, output: str, model, optimizer, step, options: TrainOptions) -> None:
        self.output = output
        self.directory = checkpoints_directory(output)  # written at the first save, not before
        self.options = _training_options(options)
        self.step_var = tf.Variable(0, dtype=tf.int64, trainable=False)
        objects = {"model": model, "optimizer": optimizer, "steps_done": self.step_var}
        state = getattr(step, "_state", None)
        if state is not None:  # the noise key is deliberately not among these
            objects["noise_step"] = state.step
            objects["noise_history"] = list(tf.nest.flatten(getattr(state, "history", ())))
        self.checkpoint = tf.train.Checkpoint(**objects)
        self.manager = tf.train.CheckpointManager(self.checkpoint, self.directory, max_to_keep=2)
        self.state_file = storage.join(self.directory, STATE_FILE)
        self.next_state_file = storage.join(self.directory, NEXT_STATE_FILE)
        self.training = getattr(step, "training", None)
        self.run = getattr(step, "run", None)

    def save(self, done: int, metrics: list[dict], plan: PrivacyPlan | None, record: Callable[[], None]) -> None:
        """Write the checkpoint of step `done`; `record()` enters it in the ledger (see the class)."""
        self.step_var.assign(done)
        internal_path(self.output, CHECKPOINTS)  # its NOTICE first: never published
        path = self.manager.save(checkpoint_number=done)
        state = CheckpointState(
            step=done,
            checkpoint=path,
            evaluations=tuple(metrics),
            plan=None if plan is None else plan.to_json(),
            training=self.training,
            run=self.run,
            options=self.options,
        )
        text = state.text()
        storage.write_text(self.next_state_file, text)  # after the files it names
        record()
        storage.write_text(self.state_file, text)

    def restore(self, state: CheckpointState, plan: PrivacyPlan | None) -> None:
        """Restore the checkpoint that `state` (`interrupted_state`) names. Refused unless it was written under
        the same plan (which the batches and a --pretrained model's files define too; the options are checked
        before: `refuse_other_options`)."""
        stated = None if plan is None else json.loads(json.dumps(plan.to_json(), default=list))
        if state.plan != stated:
            was, now = state.plan or {}, stated or {}
            differing = sorted(key for key in was.keys() | now.keys() if was.get(key) != now.get(key))
            raise OptionError(
                "{resume}: {0} was written under another privacy plan (its {1} differ: the options, the "
                "batches or a {pretrained} model's files changed); train afresh",
                self.directory,
                ", ".join(differing),
            )
        # The checkpoint's own name, in this OUTPUT: a copy of OUTPUT resumes its own files, not the original's.
        path = storage.join(self.directory, posixpath.basename(state.checkpoint))
        try:
            self.checkpoint.restore(path).assert_existing_objects_matched()
        except Exception as error:  # TensorFlow's errors, a mismatch, a damaged object graph (a DecodeError)
            raise OptionError(
                "{resume}: cannot restore {0}, which {1} names: {2}", path, self.state_file, str(error)
            ) from error
        if int(self.step_var.numpy()) != state.step:
            raise OptionError(
                "{resume}: {0} holds step {1}, not step {2}", path, int(self.step_var.numpy()), state.step
            )
        # Resumed from next_state.json: it becomes state.json, which the next crash falls back on
        storage.write_text(self.state_file, state.text())


# The TrainOptions fields that say how one run of a training goes, not which training it is: a --resume may
# give others. resume and replace: what this run does with OUTPUT; checkpoint_every: how often it saves;
# internal_scalars: the internal diagnostics of the steps this run takes, no part of the model nor of what is
# published; mc_workers and mc_runner: where the accountant draws its Monte Carlo samples (the plan they give is
# compared on its own: `Checkpoints.restore`); tpu: the address of the TPU (--distribution is compared);
# batches_copy and file_system_options: where batches at a URL are copied and how their file system is reached
# (the batches themselves are compared by their SHA-256s).
RUN_ONLY_OPTIONS = frozenset(
    {
        "resume",
        "replace",
        "checkpoint_every",
        "internal_scalars",
        "mc_workers",
        "mc_runner",
        "tpu",
        "batches_copy",
        "file_system_options",
    }
)


def _training_options(options: TrainOptions) -> dict:
    """The options that define a training, as state.json records them: every TrainOptions field but
    RUN_ONLY_OPTIONS, by name, as JSON values."""
    fields = {field.name: getattr(options, field.name) for field in dataclasses.fields(options)}
    return json.loads(json.dumps({name: value for name, value in fields.items() if name not in RUN_ONLY_OPTIONS}))


def refuse_other_options(output: str, state: CheckpointState, options: TrainOptions) -> None:
    """Refuse a --resume into OUTPUT whose options define another training than the interrupted one (`state`,
    from `interrupted_state`), naming each option that differs (by its flag on the command line, by its name
    for a Python caller): it would finish that training under other settings, and metrics.json would record
    them as the training's. An option that one of the two madp versions has not is not compared. A state
    without "options" (written by a madp that did not record them) is accepted as it was then: its evaluation
    data is compared (else evaluations kept internal could be published) and its plan (`Checkpoints.restore`)."""
    recorded = state.options
    if recorded is None:
        evaluated_on = {"eval_data": options.eval_data, "eval_data_public": options.eval_data_public}
        if state.evaluated_on != evaluated_on:
            raise OptionError(
                "{resume}: the interrupted training evaluated with {0}, not {1}: resume with the same "
                "{eval_data} and {eval_data_public}",
                state.evaluated_on,
                evaluated_on,
            )
        return
    given = _training_options(options)
    differing = [name for name, value in given.items() if name in recorded and recorded[name] != value]
    if differing:
        each = ", ".join(
            f"{_as_given(name, recorded[name])} (this run: {_as_given(name, given[name])})" for name in differing
        )
        raise OptionError(
            "{resume} continues the interrupted training in {0}, which ran with other options than this run: "
            + each
            + ". Resume with its options, or move {1} away to train afresh (the trainings ledger keeps the "
            "interrupted training, and a new one composes with it)",
            output,
            checkpoints_directory(output),
        )


def _as_given(name: str, value) -> str:
    """Option `name` with `value` as its flag gives it, in an `OptionError`'s template (the option by its
    placeholder, the value as text): "{learning_rate} 0.05", "{retrain}", "no {l2}"."""
    option = f"{{{name}}}"
    if value is None or value is False or value == []:
        return f"no {option}"
    if value is True:
        return option
    if name == "model_path":  # repeated
        return " ".join(f"{option} {_literal(directory)}" for directory in value)
    return f"{option} {_literal(','.join(value) if isinstance(value, list) else value)}"


def _literal(value) -> str:
    """A value's text as an `OptionError`'s template holds it: braces doubled, so that it reads as written."""
    return str(value).replace("{", "{{").replace("}", "}}")


def interrupted_state(output: str, batches_dir: str) -> CheckpointState | None:
    """The state of OUTPUT's checkpoint to resume from, or None if it holds none: next_state.json where a
    crash came between its checkpoint's ledger write and state.json (the ledger's entry names its run and
    step: nothing earlier may continue), else state.json (the ledger has not moved past it). Reads only."""
    directory = checkpoints_directory(output)
    state = _read_state(storage.join(directory, STATE_FILE))
    following = _read_state(storage.join(directory, NEXT_STATE_FILE))
    if following is None or following.training is None:
        return state
    if state is not None and state.training != following.training:
        return state
    entry = entry_of(ledger_of(batches_dir), following.training)
    if entry is not None and (entry.run, entry.resumable_from) == (following.run, following.step):
        return following
    return state


def after_stop(output: str, batches_dir: str) -> str:
    """What an interrupted or failed `madp train` into OUTPUT kept, and how to go on (the end of the command
    line's one line on it): its checkpoint and --resume; or, where the batches' ledger holds the training
    as finished (it stopped while writing its outputs) or no checkpoint was kept, a new training."""
    try:
        state = interrupted_state(output, batches_dir)
        training = None if state is None else state.training  # None: a non-private training
        entry = entry_of(ledger_of(batches_dir), training) if training is not None else None
    except InputError as error:  # a damaged state or ledger, which --resume names too
        return f"its checkpoint state cannot be read ({error_text(error)})"
    fresh = (
        "train again, into a new OUTPUT" if storage.kind(storage.join(output, "logs")) != "missing" else "train again"
    )
    kept = f" ({aside})" if (aside := replaced_kept(output)) else ""
    if entry is not None and entry.state == FINISHED:
        if state is not None and state.step == entry.resumable_from:
            return (
                f"the training ran all its steps, but its outputs were not all written or its checkpoint not "
                f"removed: the same command with --resume writes them from the checkpoint of its last step, running "
                f"no step again{kept}"
            )
        return (
            f"the training ran all its steps (the trainings ledger holds it as finished) but {output} was not all "
            f"written, so it cannot be resumed: {fresh} (composed with it)"
        )
    if state is not None:
        return (
            f"{output} keeps the checkpoint of step {state.step}: the same command with --resume continues from "
            f"it{kept}"
        )
    if storage.kind(storage.join(output, "privacy.json")) == "file":  # a --replace training's: the one it replaced
        return f"{output} holds a finished training, whole (privacy.json with it), and no checkpoint to resume"
    return f"{output} keeps no checkpoint (--checkpoint-every writes them): {fresh}"


def _is_evaluation(entry: Any) -> bool:
    """{"step": int, metric: number, ...}, as the trainer appends them."""
    return (
        isinstance(entry, dict)
        and type(entry.get("step")) is int
        and all(isinstance(value, int | float) and not isinstance(value, bool) for value in entry.values())
    )


@dataclasses.dataclass(frozen=True)
class CheckpointState:
    """What OUTPUT/internal/checkpoints/state.json (and next_state.json, `Checkpoints`) says of a checkpoint:
    the step it holds, its files, the evaluations so far and what a resume must match. Its JSON (`to_json`)
    is the file's object, its fields in this order; a state an earlier madp wrote lacks `options` and holds
    `evaluated_on` instead (`refuse_other_options`), and one written before trainings had an id has no
    `training` nor `run`."""

    step: int  # the steps done: the step the checkpoint holds
    checkpoint: str  # the checkpoint's path, as TensorFlow's manager named it (its base name is read)
    evaluations: tuple[dict[str, float], ...]  # "eval": {"step": int, metric: number, ...}, as the trainer took them
    plan: dict[str, Any] | None  # the plan trained under, as its JSON (None: a non-private training)
    training: str | None  # the training's id in the trainings ledger (None: a non-private training)
    run: str | None  # which run's ledger write makes next_state.json the one to resume from
    options: dict[str, Any] | None  # what a resume must give again (`_training_options`)
    evaluated_on: dict[str, Any] | None = None  # earlier madp: the evaluation data, where it recorded no options

    @classmethod
    def from_json(cls, data: Any, where: str) -> CheckpointState:
        """The state of a parsed state file (`where` names it in errors), its fields checked."""
        if not (
            isinstance(data, dict)
            and type(data.get("step")) is int
            and isinstance(data.get("checkpoint"), str)
            and isinstance(data.get("eval"), list)
            and all(_is_evaluation(entry) for entry in data["eval"])
            and isinstance(data.get("plan"), dict | None)
            and isinstance(data.get("options"), dict | None)
            and all(isinstance(data.get(name), str | None) for name in ("training", "run"))
        ):
            raise OptionError(
                "{resume}: {0} is not a checkpoint state madp wrote (a field is missing or mistyped)", where
            )
        return cls(
            step=data["step"],
            checkpoint=data["checkpoint"],
            evaluations=tuple(data["eval"]),
            plan=data.get("plan"),
            training=data.get("training"),
            run=data.get("run"),
            options=data.get("options"),
            evaluated_on=data.get("evaluated_on"),
        )

    def to_json(self) -> dict[str, Any]:
        """The state as its file holds it (`evaluated_on` only where an earlier madp recorded it)."""
        state = {
            "step": self.step,
            "checkpoint": self.checkpoint,
            "eval": list(self.evaluations),
            "plan": self.plan,
            "training": self.training,
            "run": self.run,
        }
        if self.evaluated_on is not None:
            state["evaluated_on"] = self.evaluated_on
        if self.options is not None:
            state["options"] = self.options
        return state

    def text(self) -> str:
        """The state file's text."""
        return json.dumps(self.to_json(), indent=2, default=list, allow_nan=False)


def _read_state(path: str) -> CheckpointState | None:
    """A checkpoint state file (its fields checked), or None where there is none."""
    if storage.kind(path) != "file":
        return None
    try:
        data = json.loads(storage.read_text(path))
    except (OSError, ValueError) as error:  # not JSON, not UTF-8, unreadable
        raise OptionError(
            "{resume}: cannot read {0} ({1}): not a checkpoint state madp wrote", path, str(error)
        ) from error
    return CheckpointState.from_json(data, path)
