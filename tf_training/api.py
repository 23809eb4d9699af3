"""The public Python API of `madp.training` (the package re-exports these names; its docstring has the
whole example): read a `madp batch` output step by step (`read_steps`, `steps_dataset`: `data.py`),
calibrate the privacy plan of training on it, and make a Keras model's training step private under that
plan. `madp train` (`trainer.py`) is built on `calibrate`, `make_private` and `make_non_private`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import operator
import uuid
from typing import Any

import numpy as np

from madp.core import output_lock
from madp.core.errors import InputError
from madp.core.randomness import FIXED_SEED, SecretKey
from madp.training import load_tensorflow
from madp.training.batches import Batches, open_batches
from madp.training.data import StepRows, read_steps, rows_per_step, steps_dataset
from madp.training.ledger import FINISHED, STARTED, Ledger, composed_plan, entry_of, record_training, trainings_ledger
from madp.training.options import TrainOptions
from madp.training.plan import (  # noqa: F401 (PrivacyPlan and the assumptions: exported)
    PrivacyPlan,
    labels_read_from_data,
    plan_for,
    pretrained_is_public,
    privacy_json,
)
from madp.training.queries import BandMfQuery, DpSgdQuery
from madp.training.steps import NonPrivateStep, PrivateStep, compute_precision, trace  # noqa: F401 (exported)

tf = load_tensorflow()
log = logging.getLogger("madp.train")
LEDGER_WRITER = "a private training step (enters the trainings ledger)"  # who holds the selection's lock
_LIVE_RUNS: dict[str, str] = {}  # training id -> the run (step object) of this process that trains it now

__all__ = [
    "Batches",
    "NonPrivateStep",
    "PrivacyPlan",
    "PrivateTrainingStep",
    "calibrate",
    "labels_read_from_data",
    "make_non_private",
    "make_private",
    "open_batches",
    "pretrained_is_public",
    "privacy_json",
    "read_steps",
    "steps_dataset",
]


def _step_number(value) -> int:
    """A step count given as an integer, a numpy integer or a scalar tensor (TypeError else)."""
    return operator.index(value.numpy() if hasattr(value, "numpy") else value)


def calibrate(batches: Batches, options: TrainOptions | None = None, **settings: Any) -> PrivacyPlan:
    """The privacy plan of training on `batches`: the mechanism, sigma and the (epsilon, delta) guarantee.

    The mechanism their reports imply (DP-SGD, BandMF, or DP-SGD over users), sigma from the accountant,
    and the guarantee. Unlike `madp.calibrate`, it takes opened batches and writes nothing.

    Args:
        batches: the batches (`open_batches`).
        options: `madp.training.options.TrainOptions` (None: its defaults).
        **settings: `TrainOptions` fields (over `options` where both are given), the options of `madp
            train`: `epsilon` (calibrate sigma to it) or `noise_multiplier` (sigma fixed, epsilon computed)
            or `calibration` (a calibration.json or privacy.json computed before), `delta`, `clip_norm`,
            `bands`, `strategy`, `mechanism`, `amplified`, `max_contributions`.

    Returns:
        The `PrivacyPlan` (frozen; `to_json()` is what privacy.json states).

    Raises:
        TypeError: a setting that is no `TrainOptions` field.
        madp.core.errors.InputError: mechanism "none" (no plan: use `make_non_private`), bad options
            (neither or both of epsilon and noise_multiplier, a delta out of range, a `calibration` file
            that is no plan of these batches, ...), batches whose report the accountant cannot read, or a
            target the mechanism cannot reach; the message names the option (`max_contributions`; the
            option of another step by its flag: `madp batch --max-batch-size`).

    Example:
        >>> import madp, tempfile
        >>> from madp.tools.data.synthetic import GraphSpec, generate, write_dataset
        >>> work, spec = tempfile.mkdtemp(), GraphSpec(records=400, features=4, seed=1)
        >>> _ = write_dataset(generate(spec), spec, f"{work}/records.parquet", shards=1)
        >>> _ = madp.bound(f"{work}/records.parquet", f"{work}/bounded", max_contributions=3)
        >>> _ = madp.batch(f"{work}/bounded", f"{work}/records.parquet", f"{work}/batches", steps=12,
        ...                batch_size=8, min_sep=2, seed=0)  # seed: reproducible, NOT private
        >>> from madp.training import calibrate, open_batches
        >>> plan = calibrate(open_batches(f"{work}/batches"), epsilon=8, delta=1e-5, bands=2)
        >>> plan.mechanism, plan.steps, plan.epsilon <= 8, plan.delta, round(plan.noise_multiplier, 2)
        ('bandmf', 12, True, 1e-05, 4.41)
        >>> plan.to_json()["noise_multiplier"] == plan.noise_multiplier  # what privacy.json states
        True
    """
    options = TrainOptions(**settings) if options is None else dataclasses.replace(options, **settings)
    plan = plan_for(batches, options)
    if plan is None:
        raise InputError("mechanism 'none' trains without a privacy plan: use make_non_private")
    return plan


def _as_array(values) -> np.ndarray:
    """A tensor's values (an eager one's) or an array-like's, as a numpy array."""
    return np.asarray(values.numpy() if hasattr(values, "numpy") else values)


class PrivateTrainingStep(PrivateStep):
    """A private training step (`make_private`): `step(x, y, weight, index=rows["step"])` trains on one
    step's rows (`users=` each row's user too, for user-sampled batches).

    Each call takes all the rows of the next step of the batches, which `index`, the rows' own `step`,
    names (`check_index`): its noise is keyed by the step's index, BandMF's depends on the steps before.

    Args:
        model: the Keras model it trains.
        loss: the per-row loss, `loss(y, outputs)`.
        optimizer: the Keras optimizer that applies the noised gradient.
        query: the DPQuery that clips and noises (`queries.DpSgdQuery` or `queries.BandMfQuery`).
        plan: the plan it trains under, any composition with earlier trainings included.
        own_plan: this training's plan alone.
        training: its id in the selection's trainings ledger.
        output: what the ledger says the training writes.
        strategy: a tf.distribute strategy (None: the default one).
        rows_per_replica: the rows each replica's share is padded to (None: no padding).
        jit_compile: whether the step is compiled with XLA.
        l2: the L2 penalty's coefficient, added outside the clipping.

    Returns:
        Made by `make_private`, not by hand. `plan` is the plan it trains under, with `noise` (where the
        noise comes from), `private` (whether the model will hold the plan's guarantee) and any
        composition with earlier trainings on the same selection set; `own_plan` is this training's
        alone. `training` is its id in the selection's trainings ledger, which it enters once its first
        noisy gradient is computed, just before that update is applied. `loss_fn` is the loss it trains
        with, the model's outputs taken in float32 (under mixed precision). `steps_taken` counts its steps.

    Raises:
        madp.core.errors.InputError: (from a call) rows that are not all the rows of its next step
            (`check_index`), a step past the plan's T steps, or a step whose training another
            continuation took over.

    Example::

        step = make_private(model, loss, tf_keras.optimizers.SGD(0.5), plan)
        step(rows["features"], rows["label"], rows["weight"], index=rows["step"])
        step.plan.private, step.plan.epsilon  # private: True with a fresh noise key
    """

    def __init__(
        self,
        model,
        loss,
        optimizer,
        query,
        plan: PrivacyPlan,
        own_plan: PrivacyPlan,
        training: str,
        output: str,
        strategy=None,
        rows_per_replica: int | None = None,
        jit_compile: bool = False,
        l2: float = 0.0,
    ):
        super().__init__(
            model,
            loss,
            optimizer,
            query,
            plan.expected_batch_size,
            user_level=plan.sampler == "users",
            strategy=strategy,
            rows_per_replica=rows_per_replica,
            jit_compile=jit_compile,
            l2=l2,
        )
        self.plan = plan
        self.own_plan = own_plan
        self.training = training
        self.output = output  # what the ledger says the training writes
        self.steps_taken = 0
        self.retrain = False  # whether a composition that re-uses the secret sampling is accepted
        self.continues = False  # whether `training` is an interrupted ledger entry this step continues
        self.releases_from_checkpoints = False  # see make_private
        self.ledger: Ledger | None = None  # where a private training is entered (None: not private)
        self.step_rows: StepRows | None = None  # the rows and records each step of the batches holds
        self.run = uuid.uuid4().hex  # this object's run of `training` (a continuation is another run)
        self._entered = False

    def __call__(self, x, y, weight, users=None, index=None) -> None:
        """The next step on its rows, which `index` names (`check_index`)."""
        self.check_index(index, weight)
        super().__call__(x, y, weight, users)

    def check_index(self, index, weight) -> None:
        """Refuse rows (their `weight`s) unless they are all the rows of the next step: `index` is the rows'
        own `step` (one entry per row, as `read_steps` and `steps_dataset` give them, padding rows' too),
        every entry the next step's number, and there are as many rows as the batches hold for that step (an
        empty `step` where it holds none), no more of them of non-zero weight than its records.
        The plan accounts for each step's own records, once, in order: rows of another step, of several, a
        part of a step or its rows twice (padding rows given a record's weight among them) would be released
        under noise the accounting did not plan for them. A number (a count, `enumerate`'s) says nothing of
        the rows: refused."""
        rows = len(weight)
        if self.steps_taken >= self.plan.steps:
            raise InputError(self._past_the_plan())
        if index is None:
            raise InputError(
                "a private step needs the rows' own step: step(x, y, weight, index=rows['step']) with the rows "
                "read_steps or steps_dataset give, one step's per call"
            )
        values = _as_array(index)
        if values.ndim == 0:
            raise InputError(
                f"index={values.item()!r} is a number, which says nothing of the rows it comes with: pass the "
                f"rows' own step, index=rows['step'] (one entry per row, as read_steps and steps_dataset give them)"
            )
        if values.ndim != 1 or (values.size and values.dtype.kind not in "iu"):
            raise InputError(
                f"index of shape {values.shape} and dtype {values.dtype}: pass the rows' own step, index=rows['step'] "
                f"(one integer per row)"
            )
        if len(values) != rows:
            raise InputError(
                f"index holds {len(values)} entries for {rows} rows: pass the rows' own step (rows['step'])"
            )
        step, found = self.steps_taken, np.unique(values)
        if len(found) > 1 or (len(found) and found[0] != step):
            given = f"step {found[0]}" if len(found) == 1 else f"steps {found[0]} to {found[-1]} in one call"
            raise InputError(
                f"rows of {given} where step {step} is next: take every step once, in order, whole (no shuffle, "
                f"filter or repeat, no unbatch and batch again); continuing after step k, skip the first k "
                f"(steps_dataset(...).skip(k), with make_private(..., resumed_at=k))"
            )
        if self.step_rows is None:
            return
        held, records = self.step_rows.rows[step], self.step_rows.records[step]
        weighted = int(np.count_nonzero(_as_array(weight)))
        if rows != held or weighted > records:  # rows of weight 0 withhold records (an audit's), never add one
            given = f"{rows} rows" if rows != held else f"{weighted} rows of non-zero weight"
            holds = f"holds {held}" if rows != held else f"holds {records} records (and {held - records} padding rows)"
            raise InputError(
                f"{given} where step {step} {holds}: each call takes all the rows of one step, once, as "
                f"read_steps or steps_dataset give them, with their weights (not a part, no row twice, no padding "
                f"of your own)"
            )

    def apply(self, x, y, weight, groups) -> None:
        """The next step (what a call does); refused past the plan's T steps, which the guarantee covers. The
        first step of a run computes its noised gradient, then enters the training in the ledger, then
        applies it: a step that fails before its update (a model XLA cannot compile, whose call cannot be
        traced, or that fails as it runs) leaves no entry, since only the first update releases anything
        of the data. Interrupted after it, the training stays entered."""
        self.lower_once(self._replica_step, (x, y, weight, groups))
        if self._entered:
            self._count_step()
            super().apply(x, y, weight, groups)
            return
        noised = self._noised_update(x, y, weight, groups)
        trace(self._apply_noised, (noised,))  # the update's graph is built before the entry, applied after
        self._count_step()
        self._apply_noised(noised)

    def privatized_gradient(self, x, y, weight, users=None, index=None):
        """As `PrivateStep.privatized_gradient`, for the next step, which `index` names (`check_index`); the
        training is entered in the ledger once its first noised gradient is computed, before it is returned."""
        self.check_index(index, weight)
        gradients, state = self._noised_gradient(x, y, weight, users)
        self._count_step()
        self._keep_noise_state(state)
        return gradients

    def _past_the_plan(self) -> str:
        return (
            f"the plan accounts for {self.plan.steps} steps of these batches; step {self.steps_taken + 1} "
            f"would release more than its guarantee covers: calibrate for more steps (other batches)"
        )

    def _count_step(self) -> None:
        if self.steps_taken >= self.plan.steps:
            raise InputError(self._past_the_plan())
        if self._entered and _LIVE_RUNS.get(self.training, self.run) != self.run:
            raise InputError(self._superseded())
        last = self.steps_taken + 1 == self.plan.steps
        if not self._entered or last:  # before anything of this training can be released; one write when both
            self._enter(FINISHED if last else STARTED)
        self.steps_taken += 1

    def checkpointed(self) -> None:
        """Say that a checkpoint of this training after `steps_taken` steps is written: the ledger then
        refuses a continuation from an earlier step (whose steps after it this run may have released).
        Call it after writing each checkpoint, before releasing anything of the model; `madp train`
        does. Continue an interrupted training from its latest checkpoint. While another process holds
        the selection's lock it raises an InputError (the steps ran; the checkpoint is not recorded yet):
        call it again before releasing anything of the model."""
        if self._entered and self.steps_taken < self.plan.steps:
            self._enter(STARTED, resumable_from=self.steps_taken)

    def _superseded(self) -> str:
        return (
            f"training {self.training} was continued by another step (make_private(..., training=, "
            f"resumed_at=)) after this one entered it: this step did not run; train with that one"
        )

    def _enter(self, state: str, resumable_from: int | None = None) -> None:
        """Enter this training in its selection's ledger (a private one: a seeded noise key holds no guarantee),
        or update its entry. At its first step the ledger is read again: a training entered since this
        step was made (two steps made, then trained one after the other) would make `plan`'s composed
        guarantee false. The read and the write hold the selection's lock (`madp train` holds it for its
        whole training), so that two processes never both read the ledger before either enters it, nor
        rewrite it from a stale read; held by another process, this step does not run (call it again later)."""
        ledger = self.ledger
        if ledger is not None:
            if self.releases_from_checkpoints and not output_lock.holds(ledger.selection):
                raise InputError(
                    f"releases_from_checkpoints: this thread no longer holds the lock of {ledger.selection}; a "
                    f"continuation from the same checkpoint could run meanwhile (this step did not run)"
                )
            held = (
                contextlib.nullcontext()
                if output_lock.holds(ledger.selection)
                else output_lock.exclusive(ledger.selection, LEDGER_WRITER, keeps_content=True)
            )
            try:
                with held:
                    self._enter_locked(ledger, state, resumable_from)
            except output_lock.OutputLocked as error:
                undone = (
                    "its checkpoint was not recorded"
                    if resumable_from is not None
                    else f"step {self.steps_taken + 1} of this private training did not run"
                )
                raise InputError(f"{error} ({undone})") from None
            if not self._entered:
                _LIVE_RUNS[self.training] = self.run
        self._entered = True

    def _enter_locked(self, ledger: Ledger, state: str, resumable_from: int | None) -> None:
        if self._entered:  # the entry must still be this run's: a continuation may have taken it over
            entry = entry_of(ledger, self.training)
            if entry is None or entry.run != self.run:
                raise InputError(self._superseded())
        else:  # its first entry (a one-step plan's is FINISHED)
            if self.continues:  # again under the lock: another continuation may have entered since
                _check_continued(ledger, self.training, self.steps_taken)
            now = composed_plan(self.own_plan, training=self.training, retrain=self.retrain)
            if (now.epsilon, now.delta) != (self.plan.epsilon, self.plan.delta):
                raise InputError(
                    f"another private training entered the ledger of {ledger.selection} after this step was made: "
                    f"its plan's ({self.plan.epsilon:.4g}, {self.plan.delta:.3g}) no longer states the composition "
                    f"({now.epsilon:.4g}, {now.delta:.3g}); make the step again (make_private) to train under "
                    f"it (nothing of this training ran)"
                )
        if state == FINISHED:
            resumable_from = self.plan.steps
        elif resumable_from is None:
            # The earliest step a later continuation may restart at: after this run's first step, which
            # may be released as soon as it runs, unless the caller releases only what it checkpointed.
            resumable_from = self.steps_taken + (0 if self.releases_from_checkpoints else 1)
        record_training(ledger, self.training, self.output, self.own_plan, state, resumable_from, self.run)


def make_private(
    model,
    loss,
    optimizer,
    plan: PrivacyPlan,
    *,
    noise_seed: int | None = None,
    strategy=None,
    rows_per_replica: int | None = None,
    jit_compile: bool = False,
    testing_noise_scale: float = 1.0,
    resumed_at: int = 0,
    training: str | None = None,
    output: str = "Python API",
    retrain: bool = False,
    releases_from_checkpoints: bool = False,
    validation_data_public: bool = False,
    l2: float = 0.0,
) -> PrivateTrainingStep:
    """The private training step of `model` under `plan`: clipped gradients, noised as the plan accounts.

    Per step, each row's gradient of `weight * loss(y, model(x))` (each user's average gradient for
    user-sampled batches) is clipped to `plan.clip_norm`, the sum is noised (DP-SGD's z_t, or BandMF's
    C^-1 z with `plan.bands`, sigma `plan.noise_multiplier`), divided by the expected batch size (never
    the step's real size) and applied by `optimizer`. The model clips without per-example gradients
    where its trainable layers are Dense, EinsumDense, Embedding, LayerNormalization or
    MultiHeadAttention (`madp.training.clipping`), else with them, naming the other layers in the log.

    Each call names its step by its rows: `step(x, y, weight, index=rows["step"])`, the rows' own step (one
    entry per row, as `read_steps` and `steps_dataset` give them), and the step refuses a number, rows of
    any step but its next, rows of several steps, and other than all the rows the batches hold for that
    step (`PrivateTrainingStep.check_index`). `x` is an array, or a dict of arrays for a model of several
    inputs. As a Keras model's `train_step` (`keras_train_step`), `fit` with `validation_data` and a
    callback that acts on what it measures (EarlyStopping, ReduceLROnPlateau,
    ModelCheckpoint(save_best_only=True), any callback of your own) is refused: the model fit returns
    would be chosen by a noiseless statistic of the validation records (see `validation_data_public`).

    The noise key is 128 bits of fresh entropy, drawn here and held in memory only (see `noise_seed`).

    The trainings ledger is kept with the selection the batches were made from (`SELECTED/trainings.jsonl`,
    `batches.selection`), shared by every batch output made from it: a private step enters its training
    there once its first noisy gradient is computed, just before it is applied (as `output`, e.g. where the
    model will be written; a step that fails before then leaves no entry), and marks it finished at step
    T. A step made on batches whose selection earlier private trainings used,
    finished or interrupted, states the composition of all of them as `step.plan`'s (epsilon, delta)
    (`step.own_plan`: this training alone): trainings on the same batches as one release at their
    equivalent noise multiplier (they share the sampling), trainings on other batches of the selection as
    independent releases. Where the plan relies on the secret sampling and an earlier training used these
    batches, which it would re-use, it is refused unless `retrain=True`. Seeded or scaled noise (not
    private) is neither entered nor composed.

    Continuing an interrupted training (`resumed_at`, `training`): release nothing of the model before
    checkpointing it, and continue from the latest checkpoint: every step a run took after its start may
    have been released, and running it again with new noise would release it twice. madp cannot see what
    you write, so the ledger keeps the earliest step a continuation may start at (`resumable_from`): the
    step after the last run's start, or the step of its latest `step.checkpointed()`; a continuation from
    an earlier step is refused, and so is a step object whose training another continuation has taken
    over (at its next call in this process; in another, at its next ledger write: its next
    `checkpointed()`, else its last step).

    Args:
        model: a tf_keras or a Keras 3 model, built under `strategy.scope()` where a `strategy` is given.
        loss: `loss(y, outputs)`, one loss per row (no reduction), e.g.
            `tf.nn.sigmoid_cross_entropy_with_logits` or a Keras loss built with `reduction="none"`.
        optimizer: an optimizer of the same Keras as `model` (a mismatch is an InputError), built under
            `strategy.scope()` where a `strategy` is given.
        plan: the privacy plan (`calibrate`).
        noise_seed: derives the noise key from a seed instead, for tests: anyone who knows the seed
            regenerates the noise, so a warning is logged and the step's plan says `private: False`, as it
            does for batches sampled with a fixed seed that the plan's amplification relies on. This
            warning and `testing_noise_scale`'s name the `madp train` options of these settings.
        strategy: a tf.distribute strategy: a call then splits the step's rows over its replicas (a
            user's rows on one replica).
        rows_per_replica: each replica's share is padded with zero-weight rows to it where given (static
            shapes, for TPUs, and for XLA).
        jit_compile: True compiles the step with XLA (one device only): XLA compiles once per shape, so
            give `rows_per_replica` (e.g. `batches.max_rows_per_step`) and every step is padded to it. Its
            noise has the same law, but other draws than without XLA for the same seed.
        testing_noise_scale: scales the noise but not the claim (testing only; not private either).
        resumed_at: k continues a training whose first k steps ran in an earlier step object (restore its
            checkpoint into the model, optimizer and the step's noise state): the step counts from k, and
            its noise key is a new one, so no noise draw of the earlier run is reused (with `noise_seed`, a
            key derived from the seed and k, reproducible for tests). An integer, or e.g.
            `optimizer.iterations`.
        training: the interrupted step's `training` id (with `resumed_at`), so that its ledger entry is
            continued rather than composed with (None: a new training, with a new id).
        output: what the ledger says the training writes, e.g. where the model will be written.
        retrain: accept a composition that re-uses the secret sampling of an earlier training on these
            batches.
        releases_from_checkpoints: True is for a caller that holds the selection's lock for the whole
            training (`output_lock.exclusive(batches.selection, ...)`), calls `checkpointed()` after every
            checkpoint and releases nothing of the model before checkpointing it, as `madp train` does: a
            run then leaves its start step resumable until its first checkpoint.
        validation_data_public: True is your word that `fit`'s validation data are public (no record of a
            user the guarantee protects), as `madp train --eval-data-public` is.
        l2: adds `l2` times each trainable weight to the noised gradient before `optimizer` applies it (an
            L2 penalty (l2 / 2) ||w||^2, outside the clipping: a function of the weights alone, it costs
            no privacy).

    Returns:
        The `PrivateTrainingStep`: call it once per step, in order; `step.plan` is the plan it trains
        under (composed with earlier trainings), `step.own_plan` this training's alone.

    Raises:
        madp.core.errors.InputError: a model and optimizer of different Keras, a model with trainable
            BatchNormalization, a negative or infinite `l2`, `resumed_at` that is no step count of the
            plan, `training=` without `resumed_at` or naming no interrupted training of these batch files
            (or one continued past `resumed_at`), a composition that re-uses the secret sampling without
            `retrain=True`, a trainings ledger madp did not write, or `releases_from_checkpoints` without
            the selection's lock; the message names the parameter, layer or file.

    Example:
        >>> import madp, tempfile
        >>> from madp.tools.data.synthetic import GraphSpec, generate, write_dataset
        >>> work, spec = tempfile.mkdtemp(), GraphSpec(records=400, features=4, seed=1)
        >>> _ = write_dataset(generate(spec), spec, f"{work}/records.parquet", shards=1)
        >>> _ = madp.bound(f"{work}/records.parquet", f"{work}/bounded", max_contributions=3)
        >>> _ = madp.batch(f"{work}/bounded", f"{work}/records.parquet", f"{work}/batches", steps=12,
        ...                batch_size=8, min_sep=2, seed=0)  # seed: reproducible, NOT private
        >>> from madp.training import load_tensorflow, open_batches, read_steps
        >>> tf = load_tensorflow()  # TensorFlow with legacy Keras (tf_keras), as madp trains
        >>> import tf_keras
        >>> model = tf_keras.Sequential([tf_keras.layers.Dense(1, input_shape=(4,))])
        >>> def loss(labels, logits):  # one loss per row
        ...     labels = tf.cast(labels[:, None], tf.float32)
        ...     return tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits)[:, 0]
        >>> from madp.training import calibrate, make_private
        >>> batches = open_batches(f"{work}/batches")
        >>> plan = calibrate(batches, epsilon=8, delta=1e-5, bands=2)
        >>> step = make_private(model, loss, tf_keras.optimizers.SGD(0.5), plan)
        >>> for rows in read_steps(batches, ["features", "label"]):  # every step, in order, named by its rows
        ...     step(rows["features"], rows["label"], rows["weight"], index=rows["step"])
        >>> step.steps_taken, step.plan.private, step.plan.epsilon <= 8  # private: a fresh noise key
        (12, True, True)
    """
    resumed_at = _steps_taken(resumed_at, plan)
    # Drawn once per step object (a resumed training draws anew), never written anywhere.
    purpose = "training noise" if not resumed_at else f"training noise, resumed at step {resumed_at}"
    noise_key = SecretKey.for_run(noise_seed, purpose, "--noise-seed")
    plan = _with_noise(plan, noise_key, testing_noise_scale)
    query = _noise_query(plan, noise_key, testing_noise_scale, model)
    ledger = trainings_ledger(plan.trained_on) if plan.private and plan.trained_on else None
    continues = False
    if training is not None and ledger is not None:
        _check_continued(ledger, training, resumed_at)
        continues = True
    training = training or uuid.uuid4().hex
    released = composed_plan(plan, training=training, retrain=retrain) if ledger is not None else plan
    step = PrivateTrainingStep(
        model, loss, optimizer, query, released, plan, training, output, strategy, rows_per_replica, jit_compile, l2
    )
    step.steps_taken, step.retrain = resumed_at, retrain
    step.continues = continues
    step.releases_from_checkpoints = releases_from_checkpoints
    step.validation_data_public = validation_data_public
    step.ledger = ledger
    if plan.trained_on:
        step.step_rows = rows_per_step(plan.trained_on)
    if releases_from_checkpoints and ledger is not None and not output_lock.holds(ledger.selection):
        raise InputError(
            f"releases_from_checkpoints: hold the lock of {ledger.selection} (output_lock.exclusive) for the whole "
            f"training, so that no other run of it continues from the same checkpoint meanwhile"
        )
    return step


def _steps_taken(resumed_at, plan: PrivacyPlan) -> int:
    """`resumed_at` as a count of the plan's steps: an integer, or e.g. `optimizer.iterations` (a
    tf.Variable) or its numpy()."""
    try:
        steps = _step_number(resumed_at)
    except TypeError:
        raise InputError(f"resumed_at={resumed_at!r}: the number of steps the interrupted training took") from None
    if not 0 <= steps <= plan.steps:
        raise InputError(f"resumed_at={steps}: not a step count of this plan's {plan.steps} steps")
    return steps


def _with_noise(plan: PrivacyPlan, noise_key: SecretKey, testing_noise_scale: float) -> PrivacyPlan:
    """The plan as the step's noise makes it: private only with a fresh noise key at full scale, and with
    secretly sampled batches where the plan relies on the secret sampling; a warning says why a model is not."""
    broken = testing_noise_scale != 1.0
    plan = dataclasses.replace(
        plan,
        noise=noise_key.status
        if not broken
        else f"scaled by {testing_noise_scale:g} for testing (--testing-only-noise-scale) - not private",
        private=noise_key.seed is None
        and not broken
        and (plan.sampling != FIXED_SEED or not plan.relies_on_secret_sampling),
    )
    if not plan.private:
        log.warning(
            "this model is NOT private: %s",
            "the noise comes from --noise-seed"
            if noise_key.seed is not None
            else "its noise is scaled by --testing-only-noise-scale"
            if broken
            else "its batches were sampled with a fixed --seed",
        )
    return plan


def _noise_query(
    plan: PrivacyPlan, noise_key: SecretKey, testing_noise_scale: float, model
) -> DpSgdQuery | BandMfQuery:
    """The DPQuery that clips each gradient to the plan's clip norm and noises their sum: DP-SGD's z_t, or
    BandMF's C^-1 z over the model's trainable variables, at sigma times `testing_noise_scale`."""
    noise = plan.noise_multiplier * testing_noise_scale  # the claim stays at sigma
    if plan.mechanism in ("dpsgd", "dpsgd-uls"):
        return DpSgdQuery(plan.clip_norm, noise, noise_key)
    specs = [tf.TensorSpec(v.shape, v.dtype) for v in model.trainable_variables]
    return BandMfQuery(plan.clip_norm, noise, noise_key, plan.bands, specs)


def _check_continued(ledger: Ledger, training: str, resumed_at: int) -> None:
    """`training=` names the ledger entry a resumed training continues: one that exists and has not
    finished, continued on the batch files it trained on, after the steps it took, or a finished one at
    its last step (it runs no step). Any other use would train under one entry, counted once in every
    later composition, more steps or other samplings than its plan accounts for."""
    if not resumed_at:
        raise InputError(
            f"training={training!r} continues an interrupted training: pass resumed_at (the steps it took), "
            f"or leave training out for a new training (entered and composed on its own)"
        )
    entry = entry_of(ledger, training)
    if entry is None:
        raise InputError(
            f"training={training!r} is not in the trainings ledger of {ledger.selection}: nothing to continue"
        )
    if entry.batch_files != ledger.batch_files:
        raise InputError(
            f"training={training!r} trained on other batch files than {ledger.batches} holds now (batched again "
            f"since it started): its later steps would train on another sampling than its first ones, which its "
            f"plan does not account for; continue it on the batches it trained on, or train anew (a new training, "
            f"composed with it)"
        )
    resumable_from = entry.resumable_from
    if entry.state != STARTED:
        if resumed_at == resumable_from:  # from its last step's checkpoint: no step runs again, nothing new
            return  # is released; a run stopped while writing its outputs writes them so
        raise InputError(
            f"training={training!r} finished all its steps on {ledger.batches}: it cannot be continued; train "
            f"anew (a new training, composed with it)"
        )
    if resumed_at < resumable_from:
        raise InputError(
            f"training={training!r} was continued or run past step {resumed_at} already (the ledger of "
            f"{ledger.selection} accepts a continuation from step {resumable_from} on): resumed_at={resumed_at} "
            f"would run steps it may have released again, with new noise, which its entry's plan does not "
            f"account for; continue from a later checkpoint, or train anew (a new training, composed with it), "
            f"or, if nothing after step {resumed_at} was released, continue with releases_from_checkpoints=True"
        )


def make_non_private(
    model,
    loss,
    optimizer,
    *,
    strategy=None,
    rows_per_replica: int | None = None,
    jit_compile: bool = False,
    l2: float = 0.0,
) -> NonPrivateStep:
    """The baseline step, no privacy: the mean of `weight * loss(y, model(x))` over the step's real rows.

    No clipping, no noise, no ledger entry. Its metrics are internal: no guarantee covers them.

    Args:
        model: a tf_keras or a Keras 3 model, as for `make_private`.
        loss: `loss(y, outputs)`, one loss per row, as for `make_private`.
        optimizer: an optimizer of the same Keras as `model`.
        strategy: as for `make_private`.
        rows_per_replica: as for `make_private`.
        jit_compile: as for `make_private`.
        l2: as for `make_private`.

    Returns:
        The `NonPrivateStep`: `baseline(x, y, weight)` trains on one step's rows.

    Raises:
        madp.core.errors.InputError: a model and optimizer of different Keras, or a negative or infinite
            `l2`.

    Example:
        >>> import numpy as np
        >>> from madp.training import load_tensorflow, make_non_private
        >>> tf = load_tensorflow()  # TensorFlow with legacy Keras (tf_keras), as madp trains
        >>> import tf_keras
        >>> model = tf_keras.Sequential([tf_keras.layers.Dense(1, input_shape=(4,))])
        >>> loss = tf_keras.losses.BinaryCrossentropy(from_logits=True, reduction="none")  # one loss per row
        >>> baseline = make_non_private(model, loss, tf_keras.optimizers.SGD(0.5))
        >>> x, y = np.ones((3, 4), np.float32), np.array([[0.0], [1.0], [1.0]], np.float32)
        >>> baseline(x, y, np.array([1.0, 1.0, 0.0], np.float32))  # the mean over the 2 rows of weight 1
        >>> int(baseline.optimizer.iterations)
        1

    On batches, a step per `read_steps` step (no `index`: nothing to account)::

        for rows in read_steps(batches, ["features", "label"]):
            baseline(rows["features"], rows["label"], rows["weight"])
    """
    return NonPrivateStep(model, loss, optimizer, strategy, rows_per_replica, jit_compile, l2)
