"""One training step, private (DP-SGD or DP-BandMF through a DPQuery) or not, and how a step's
rows are spread over the replicas of a tf.distribute strategy."""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from typing import Any

import numpy as np

from madp.core.errors import InputError, OptionError, nonnegative
from madp.training import load_tensorflow
from madp.training.clipping import LOSS_NOT_PER_ROW, WRITES_VARIABLES, per_example_gradients, user_averages
from madp.training.ghost_clipping import (
    NoFastClipping,
    float32_despite_policy,
    ghost_clipped_sum,
    unsupported_layers,
)
from madp.training.queries import clip_and_sum

tf = load_tensorflow()
import tf_keras  # noqa: E402

log = logging.getLogger("madp.train")


def _matching_optimizer(model, optimizer) -> bool:
    """Check that `optimizer` is of `model`'s Keras (tf_keras or Keras 3: neither can update the other's
    variables, which fails deep in apply_gradients); build a Keras 3 optimizer's slots now, outside the
    step's tf.function. Returns whether it is a tf_keras optimizer (whose apply_gradients takes
    skip_gradients_aggregation: the step all-reduces the gradients itself)."""
    legacy_model = isinstance(model, tf_keras.Model)
    legacy = isinstance(optimizer, (tf_keras.optimizers.Optimizer, tf_keras.optimizers.legacy.Optimizer))
    if legacy != legacy_model:
        raise InputError(
            f"model {model.name} is a {'tf_keras' if legacy_model else 'Keras 3'} model but the optimizer is "
            f"{'a tf_keras' if legacy else 'not a tf_keras'} one: use "
            f"{'tf_keras.optimizers' if legacy_model else 'keras.optimizers (import keras)'} for it"
        )
    if not legacy and not optimizer.built:
        optimizer.build(model.trainable_variables)
    return legacy


def _apply_gradients(optimizer, legacy: bool, gradients, variables, l2: float) -> None:
    """Applies the step's mean gradients, plus `l2` times each variable (the gradient of an L2 penalty
    (l2 / 2) ||w||^2: a function of the weights alone, added after the noise, so it is not clipped and
    the guarantee does not depend on it)."""
    if l2:
        gradients = [l2 * v if g is None else tf.convert_to_tensor(g) + l2 * v for g, v in zip(gradients, variables)]
    if legacy:
        optimizer.apply_gradients(zip(gradients, variables), skip_gradients_aggregation=True)
    else:  # Keras 3: one device (the trainer refuses a distribution for it), nothing to aggregate
        optimizer.apply_gradients(zip(gradients, variables))


def _l2_penalty(l2: float) -> float:
    if not nonnegative(l2):
        raise InputError(f"l2={l2!r}: the L2 penalty must be 0 or above and finite")
    return float(l2)


class _LoweredOnce:
    """A step that, under XLA, lowers each of its compiled functions once, before it first runs."""

    model: Any
    _xla: bool
    _lowered: set[int]  # ids of the compiled functions lowered so far

    def lower_once(self, function, inputs: tuple) -> None:
        if self._xla and id(function) not in self._lowered:
            _refuse_what_xla_cannot_compile(function, self.model, inputs)
            self._lowered.add(id(function))


class _KerasFit:
    """A step as a Keras model's `train_step`, so that `model.fit` trains with it."""

    model: Any
    optimizer: Any
    # Whether fit's validation data may choose the model (a private training step: its caller's word)
    validation_data_public = True

    def __call__(self, x, y, weight, users=None, index=None) -> None: ...

    def keras_train_step(self, data) -> dict:
        """For `fit`: `model.train_step = step.keras_train_step`, `model.compile(run_eagerly=True)`, then
        `model.fit(dataset, epochs=1)` with one element per step, its (x, y, weight, index) or (x, y,
        weight, users, index), `index` the rows' own `step`: a private step refuses an element that is not
        all the rows of its next step (a number as `index`, from `enumerate`, too). Eagerly only: under
        tf.function, fit would trace it once and a private step's per-call work (its count against the
        plan's T steps, the trainings ledger) would not run per step. One replica only: a step of several
        (`make_private(..., strategy=s)`) splits a step's rows itself, from a loop. Its logs are the
        optimizer's iterations, a step count: public; what else fit shows (its progress bar's times,
        `validation_data`'s metrics without noise, callbacks') no guarantee covers. A private step
        refuses `validation_data` with a callback that acts on it (`refuse_model_selection`) unless
        `make_private(..., validation_data_public=True)`.

        >>> model.fit(steps_dataset(batches, ["features", "label"]).map(
        ...     lambda r: (r["features"], r["label"], r["weight"], r["step"])), epochs=1, verbose=0)
        """
        if not tf.executing_eagerly():
            raise InputError("keras_train_step runs each step eagerly: compile the model with run_eagerly=True")
        if not isinstance(data, (tuple, list)) or len(data) not in (4, 5):
            raise InputError(
                "keras_train_step: each element that fit reads is one step's (x, y, weight, index) or (x, y, "
                "weight, users, index); map steps_dataset's dicts to that"
            )
        context = tf.distribute.get_replica_context()  # fit calls it in one
        if context is None:
            raise InputError("keras_train_step is a model's train_step, for fit; call the step itself elsewhere")
        if context.num_replicas_in_sync > 1:  # fit would hand each replica a share of the step's rows
            raise InputError(
                "keras_train_step: fit splits each element over several replicas; under a distribution strategy, "
                "call the step from a loop of your own (it splits a step's rows over the replicas itself)"
            )
        if not self.validation_data_public:
            refuse_model_selection(self.model)
        x, y, weight, *users = data[:-1]
        context.merge_call(lambda _: self(x, y, weight, users[0] if users else None, index=data[-1]))
        return {"iterations": tf.identity(self.optimizer.iterations)}


# Keras' callbacks that never act on what fit's validation measures: they record it, or act on the epoch alone
RECORDING_CALLBACKS = frozenset(
    {"History", "ProgbarLogger", "BaseLogger", "CSVLogger", "TensorBoard", "LearningRateScheduler", "TerminateOnNaN"}
)


def _acts_on_validation(callback) -> bool:
    """Whether a fit callback may change the model fit returns, or its training, by what validation measures:
    anything but Keras' own recording callbacks, and ModelCheckpoint unless it saves every epoch."""
    cls = type(callback)
    keras_own = cls.__module__.split(".")[0] in ("keras", "tf_keras")
    if keras_own and cls.__name__ == "ModelCheckpoint":
        return bool(getattr(callback, "save_best_only", False))
    return not (keras_own and cls.__name__ in RECORDING_CALLBACKS)


def refuse_model_selection(model) -> None:
    """Refuse a `fit` of `model` with validation data and a callback that acts on it (EarlyStopping,
    ReduceLROnPlateau, ModelCheckpoint(save_best_only=True), any callback of the user's): fit measures the
    validation data without noise, so the model it returns (or how it trained) would be chosen by a
    statistic of those records that no guarantee covers. fit hands train_step its data alone, so its
    arguments are read from its frame, which calls this one (tf_keras and Keras 3 name them alike)."""
    frame = inspect.currentframe()
    while frame is not None and not (frame.f_code.co_name == "fit" and frame.f_locals.get("self") is model):
        frame = frame.f_back
    if frame is None:
        return
    arguments = frame.f_locals
    callbacks = getattr(arguments.get("callbacks"), "callbacks", arguments.get("callbacks")) or []
    acting = [type(callback).__name__ for callback in callbacks if _acts_on_validation(callback)]
    if arguments.get("validation_data") is not None and acting:
        raise InputError(
            f"fit of model {model.name} with validation_data and the callbacks {', '.join(acting)}: fit measures "
            f"the validation data without noise, and these act on what it measures, so the model it returns "
            f"would be chosen by a statistic of those records that no guarantee covers; leave them out, or, if the "
            f"validation records are public (no record of a user the guarantee protects), say so with "
            f"make_private(..., validation_data_public=True) (this step did not run)"
        )


def _refuse_what_xla_cannot_compile(function, model, inputs: tuple) -> None:
    """Lower an XLA-compiled step at its first inputs to XLA's HLO (a trace: no step runs, no noise is
    drawn, no weight changes; TensorFlow runs one eager random op to find the device, which moves its
    global unseeded draws, not the training noise's own key): a model with an op XLA has no kernel
    for is refused with an InputError naming the op, before the first step, so before a private
    training enters the trainings ledger. Without this, TensorFlow fails inside the step, with a
    traceback, after the ledger holds the training as started."""
    try:
        function.experimental_get_compiler_ir(*inputs)(stage="hlo")
    except (ValueError, tf.errors.OpError) as error:
        if "unsupported operations" not in str(error):  # not XLA's refusal (a tracing error): TensorFlow's own
            raise
        reason = str(error).removeprefix("Failed getting HLO text: ").strip("'\"").split("{{node")[0]
        raise OptionError(
            "{xla}: XLA cannot compile the steps of model {0}: {1}; train it without {xla} (this step did not run)",
            model.name,
            reason.strip()[:400],
        ) from None


class PrivateStep(_LoweredOnce, _KerasFit):
    """One DP step: clip and sum per-example gradients (query), noise, divide by expected B, apply.

    Models whose trainable layers are all Dense, EinsumDense, Embedding, LayerNormalization (also
    inside MultiHeadAttention), EmbeddingBag or PositionEmbedding take the ghost-clipping path
    (`clipping`); any other model gets vectorized per-example gradients, with one log line naming the
    layers that forced it (`fast=False` forces that path, as does user-level clipping). Under a
    tf.distribute strategy every replica clips and sums its rows, the sums are all-reduced, and every
    replica adds the same noise (the generator is keyed by (seed, step), so the replicas need not
    talk) and applies the same update.
    """

    def __init__(
        self,
        model,
        loss_fn,
        optimizer,
        query,
        expected_batch_size: float,
        fast: bool = True,
        user_level: bool = False,
        strategy=None,
        rows_per_replica: int | None = None,
        jit_compile: bool = False,
        l2: float = 0.0,
    ):
        self.model, self.loss_fn, self.optimizer, self.query = model, float32_outputs(loss_fn), optimizer, query
        self.l2 = _l2_penalty(l2)
        _warn_unapplied_regularizers(model)
        self.expected = expected_batch_size
        self.user_level = user_level
        self.legacy_optimizer = _matching_optimizer(model, optimizer)
        _refuse_batch_statistics(model)
        self.strategy = strategy or tf.distribute.get_strategy()
        on_tpu = isinstance(self.strategy, (tf.distribute.TPUStrategy, tf.distribute.experimental.TPUStrategy))
        blocking = unsupported_layers(model, on_tpu) if fast and not user_level else []
        if blocking:
            log.warning(
                "model %s: per-example gradients (vectorized, slower) for DP clipping; no fast clipping for %s",
                model.name,
                ", ".join(blocking),
            )
        self.fast = fast and not user_level and not blocking
        if self.fast and float32_despite_policy(model):
            log.warning(
                "model %s: its private steps compute in float32 (a stack of Dense layers clips by multiplying "
                "float32 inputs by the float32 weights); its layers' %s applies to its evaluations only",
                model.name,
                sorted({layer.compute_dtype for layer in model.layers} - {"float32"}),
            )
        self.rows_per_replica = rows_per_replica
        self._replica_step = _compiled_by_xla(self._apply_replica, jit_compile, self.strategy)
        self._privatized = _compiled_by_xla(self._noised, jit_compile, self.strategy)
        self._xla, self._lowered = jit_compile, set()
        # TensorFloat-32 (Ampere and later GPUs) rounds float32 products' inputs to 10 bits: a row's
        # contribution to the clipped sum would then differ from the one its norm was taken of.
        tf.config.experimental.enable_tensor_float_32_execution(False)
        # The query's global state (BandMF: the last noise vectors) lives in variables, so it never
        # crosses the tf.function boundary; all replicas compute the same state.
        with self.strategy.scope():
            self._state = tf.nest.map_structure(
                lambda t: tf.Variable(t, trainable=False, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA),
                query.initial_global_state(),
            )

    def privatized_gradient(self, x, y, weight, users=None):
        """The step's noisy clipped gradient sum over the expected batch size (one replica); advances the noise."""
        gradients, state = self._noised_gradient(x, y, weight, users)
        self._keep_noise_state(state)
        return gradients

    def _noised_gradient(self, x, y, weight, users):
        """`privatized_gradient`'s (gradient, noise state after it), the noise state not yet kept."""
        inputs = self._inputs(x, y, weight, users)
        with _input_errors_of_the_trace():
            self.lower_once(self._privatized, inputs)
            return self._privatize_once(*inputs)

    def __call__(self, x, y, weight, users=None, index=None) -> None:
        """One step on its rows; `index` is checked by a step with a plan (`make_private`), not here."""
        inputs = split_over_replicas(self.strategy, x, y, weight, self._users(users), self.rows_per_replica)
        with _input_errors_of_the_trace():
            self.lower_once(self._replica_step, inputs)
            self.apply(*inputs)

    def _users(self, users):
        if not self.user_level:
            return None
        if users is None:
            raise InputError('user-level steps need each row\'s user: step(x, y, weight, users=rows["user"])')
        return np.asarray(users)

    def _inputs(self, x, y, weight, users):
        """Groups matter only for user-level clipping; otherwise None (one row per group)."""
        users = self._users(users)
        return x, y, weight, None if users is None else tf.constant(row_groups(users, len(weight)))

    @tf.function(reduce_retracing=True)
    def _privatize_once(self, x, y, weight, groups):
        return self._privatized(x, y, weight, groups)

    @tf.function(reduce_retracing=True)
    def apply(self, x, y, weight, groups) -> None:
        """One step on (per-replica) rows and their clipping groups (`row_groups`)."""
        self.strategy.run(self._replica_step, args=(x, y, weight, groups))

    @tf.function(reduce_retracing=True)
    def _noised_update(self, x, y, weight, groups):
        """`apply` in two halves, this one computing each replica's (noised gradient, noise state after it),
        which changes no variable, `_apply_noised` applying them: a private training enters its ledger
        between the two at its first step (`PrivateTrainingStep.apply`)."""
        return self.strategy.run(self._privatized, args=(x, y, weight, groups))

    @tf.function(reduce_retracing=True)
    def _apply_noised(self, noised) -> None:
        """`apply`'s second half: keep the noise state and apply the noised gradient of `_noised_update`."""
        self.strategy.run(self._commit, args=noised)

    def _apply_replica(self, x, y, weight, groups) -> None:
        self._commit(*self._noised(x, y, weight, groups))

    def _commit(self, gradients, state) -> None:
        self._keep_noise_state(state)
        _apply_gradients(self.optimizer, self.legacy_optimizer, gradients, self.model.trainable_variables, self.l2)

    def _keep_noise_state(self, state) -> None:
        tf.nest.map_structure(lambda v, t: v.assign(t), self._state, state)

    def _noised(self, x, y, weight, groups):
        """(the noised clipped gradient sum over the expected batch size, the noise state after it) of one
        replica's rows: the noise state is read, not written."""
        state = tf.nest.map_structure(lambda v: v.read_value(), self._state)
        params = self.query.derive_sample_params(state)
        summed = None
        if self.fast:
            try:
                summed = ghost_clipped_sum(self.model, self.loss_fn, x, y, weight, params)
            except NoFastClipping as error:
                log.warning(
                    "model %s: per-example gradients (vectorized, slower) for DP clipping; fast clipping cannot clip "
                    "these calls per example (several rows for one example: a layer called on a tensor without the "
                    "batch axis first, such as position ids from a range, or a reshape or a transpose of the batch "
                    "axis in the model's call; an output not reaching the loss: a call recomputed, as by keras.remat, "
                    "or unused; a call inside a loop): %s",
                    self.model.name,
                    error,
                )
        if summed is None:
            per_example = per_example_gradients(self.model, self.loss_fn, x, y, weight)
            if self.user_level:  # the ULS record of a user: the average gradient of its rows
                per_example, _ = user_averages(per_example, weight, groups)
            summed = clip_and_sum(params, per_example)
        summed = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, summed)
        noised, state, _ = self.query.get_noised_result(summed, state)
        return [g / self.expected for g in noised], state


@contextlib.contextmanager
def compute_precision(mixed: bool):
    """A context in which new Keras layers compute in bfloat16 (mixed precision) where `mixed`.

    Inside, with `mixed`, new layers of tf_keras and of Keras 3 compute in bfloat16 and keep float32
    weights (Keras' mixed_bfloat16 policy); the global policies are restored on leaving. The steps
    take the loss of float32 outputs (`float32_outputs`) and clip in float32: each row's norm and
    the clipped sum come from that row's activations and output gradients cast to float32.

    Args:
        mixed: whether the layers built inside compute in bfloat16 (False: the context changes nothing).

    Returns:
        A context manager, entered as `with compute_precision(mixed)`.

    Raises:
        Nothing: what the block raises passes through, the policies restored.

    Example:
        >>> from madp.training import compute_precision, load_tensorflow
        >>> tf = load_tensorflow()
        >>> import tf_keras
        >>> with compute_precision(True):
        ...     hidden = tf_keras.layers.Dense(64, "relu", input_shape=(4,))
        ...     model = tf_keras.Sequential([hidden, tf_keras.layers.Dense(1)])
        >>> model.layers[0].compute_dtype, model.layers[0].dtype  # bfloat16 activations, float32 weights
        ('bfloat16', 'float32')
        >>> tf_keras.layers.Dense(1).compute_dtype  # outside: the policy it had
        'float32'

    Its private step, compiled with XLA (one shape, one compilation)::

        step = make_private(model, loss, optimizer, plan, jit_compile=True, rows_per_replica=batches.max_rows_per_step)
    """
    if not mixed:
        yield
        return
    import keras

    before = tf_keras.mixed_precision.global_policy(), keras.mixed_precision.global_policy()
    tf_keras.mixed_precision.set_global_policy("mixed_bfloat16")
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        yield
    finally:
        tf_keras.mixed_precision.set_global_policy(before[0])
        keras.mixed_precision.set_global_policy(before[1])


def float32_outputs(loss_fn):
    """`loss_fn` taking the model's floating outputs in float32: under mixed precision a bfloat16
    softmax or sum of squares keeps 8 bits; for a float32 model, nothing changes."""

    def widened(t):  # a tensor or (evaluation) an array: float32 ones pass as they are
        dtype = tf.as_dtype(t.dtype)
        return tf.cast(t, tf.float32) if dtype.is_floating and dtype != tf.float32 else t

    def loss(y, outputs):
        return loss_fn(y, tf.nest.map_structure(widened, outputs))

    return loss


def _compiled_by_xla(function, jit_compile: bool, strategy):
    """`function` (a replica's step) compiled by XLA into one program where `jit_compile`, else as is
    (traced into the caller's tf.function). XLA can fuse the clipping's elementwise work with its
    matrix products (whether that is faster depends on the device: docs/how-to/train.md, XLA and mixed precision),
    and compiles once per shape: its callers pad every step to one size (`rows_per_replica`). One
    device only: a replica function under a MirroredStrategy all-reduces across devices, which XLA
    cannot hold in one program, and TPUs compile everything anyway."""
    if not jit_compile:
        return function
    if strategy.num_replicas_in_sync > 1:
        raise InputError("XLA compilation (jit_compile, --xla) trains on one device: use --distribution default")
    return tf.function(function, jit_compile=True, reduce_retracing=True)


def trace(function, inputs: tuple) -> None:
    """Trace the tf.function `function` at `inputs` without running it (no noise is drawn, no weight
    changes; a call with inputs of the same shapes then runs the traced graph): a model whose call
    cannot be traced fails here, with the InputError of the trace where there is one."""
    with _input_errors_of_the_trace():
        function.get_concrete_function(*inputs)


@contextlib.contextmanager
def _input_errors_of_the_trace():
    """The clipping's InputErrors for a loss of one number per batch (`clipping.example_loss`) and a
    model that writes into its variables (`clipping.each_example`), raised as the step is traced, reach
    here as TensorFlow's StagingError, which keeps only their text: raised again as the InputErrors
    they were, before any noise or update."""
    try:
        yield
    except Exception as error:
        said = [
            line.strip() for line in str(error).splitlines() if LOSS_NOT_PER_ROW in line or WRITES_VARIABLES in line
        ]
        if isinstance(error, InputError) or not said:
            raise
        raise InputError(said[0].removeprefix("InputError: ")) from None


def _refuse_batch_statistics(model) -> None:
    """A trainable BatchNormalization (tf_keras, its SyncBatchNormalization, or Keras 3) normalizes each
    row by the statistics of the whole step and updates its moving statistics from them: both escape
    clipping and noise (one record moves every row's gradient, and the moving statistics are a noiseless
    function of the data written to the model), so no guarantee covers such a model. Frozen ones
    (trainable False) run in inference."""
    found = [
        layer.name
        for layer in model._flatten_layers(include_self=False, recursive=True)  # tf_keras and Keras 3 alike
        # any class named so in the MRO: tf_keras' BatchNormalization and SyncBatchNormalization share
        # BatchNormalizationBase, Keras 3's has its own
        if any("BatchNormalization" in cls.__name__ for cls in type(layer).__mro__) and layer.trainable
    ]
    if found:
        raise InputError(
            f"model {model.name}: BatchNormalization {found} mixes the rows of a step and keeps statistics of "
            f"them without noise, which no DP guarantee covers: use LayerNormalization (per row), or freeze it "
            f"(trainable = False)"
        )


def _warn_unapplied_regularizers(model) -> None:
    """A Keras regularizer adds to `model.losses`, which these steps do not train on (a penalty on the
    weights is the step's `l2`; one on activations would be a per-row loss to clip): say so rather
    than drop it silently."""
    found = sorted(
        f"{layer.name}.{name.lstrip('_')}"  # tf_keras keeps the activity one as _activity_regularizer
        for layer in model._flatten_layers(include_self=False, recursive=True)
        for name, value in vars(layer).items()
        if name.endswith("_regularizer") and value is not None and not isinstance(value, list)  # not tf_keras' own list
    )
    if found:
        log.warning(
            "model %s: its regularizers %s are not applied (madp's steps train on the loss alone): give an L2 "
            "penalty on the weights as --l2 (make_private(..., l2=)), and put a penalty on activations in the loss",
            model.name,
            ", ".join(found),
        )


class NonPrivateStep(_LoweredOnce, _KerasFit):
    """The baseline (`make_non_private`): `step(x, y, weight)` takes the mean loss over the step's real
    rows (all replicas together), no clipping, no noise.

    Args:
        model: the Keras model it trains.
        loss_fn: the per-row loss, `loss_fn(y, outputs)`.
        optimizer: an optimizer of the same Keras as `model`.
        strategy: a tf.distribute strategy (None: the default one).
        rows_per_replica: the rows each replica's share is padded to (None: no padding).
        jit_compile: whether the step is compiled with XLA.
        l2: the L2 penalty's coefficient.

    Returns:
        Made by `make_non_private`, not by hand. `loss_fn` is the loss it trains with, the model's outputs
        taken in float32 (under mixed precision), for evaluating the model the same way.

    Raises:
        madp.core.errors.InputError: a model and optimizer of different Keras, or a negative or infinite
            `l2`.

    Example::

        step = make_non_private(model, loss, tf_keras.optimizers.SGD(0.5))
        step(x, y, weight)
        float(tf.reduce_mean(step.loss_fn(y_eval, model(x_eval))))
    """

    def __init__(
        self,
        model,
        loss_fn,
        optimizer,
        strategy=None,
        rows_per_replica: int | None = None,
        jit_compile: bool = False,
        l2: float = 0.0,
    ):
        self.model, self.loss_fn, self.optimizer = model, float32_outputs(loss_fn), optimizer
        self.l2 = _l2_penalty(l2)
        _warn_unapplied_regularizers(model)
        self.legacy_optimizer = _matching_optimizer(model, optimizer)
        self.strategy = strategy or tf.distribute.get_strategy()
        self.rows_per_replica = rows_per_replica
        self._replica_step = _compiled_by_xla(self._apply_replica, jit_compile, self.strategy)
        self._xla, self._lowered = jit_compile, set()

    def __call__(self, x, y, weight, users=None, index=None) -> None:
        """One step on its rows; `users` and `index`, for the same call as a private step's, are not needed."""
        inputs = split_over_replicas(self.strategy, x, y, weight, None, self.rows_per_replica)
        self.lower_once(self._replica_step, inputs[:3])
        self.apply(*inputs)

    def checkpointed(self) -> None:
        """As a private step's, for a loop shared with one: no ledger entry records a baseline."""

    @tf.function(reduce_retracing=True)
    def apply(self, x, y, weight, groups=None) -> None:
        """One step on (per-replica) rows; `groups` (for the same call as PrivateStep's) is not needed."""
        self.strategy.run(self._replica_step, args=(x, y, weight))

    def _apply_replica(self, x, y, weight) -> None:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(self.loss_fn(y, self.model(x, training=True)) * weight)
        context = tf.distribute.get_replica_context()
        gradients, total = context.all_reduce(
            tf.distribute.ReduceOp.SUM, (tape.gradient(loss, self.model.trainable_variables), tf.reduce_sum(weight))
        )
        _apply_gradients(
            self.optimizer,
            self.legacy_optimizer,
            [g / tf.maximum(total, 1.0) for g in gradients],
            self.model.trainable_variables,
            self.l2,
        )


# --- distribution -------------------------------------------------------------------------------


def row_groups(users: np.ndarray | None, rows: int) -> np.ndarray:
    """The clipping group of each row: the row itself, or (user-level) its user's index in the step."""
    if users is None:
        return np.arange(rows, dtype=np.int32)
    return np.unique(users, return_inverse=True)[1].astype(np.int32).reshape(-1)


def shard_step(
    x: np.ndarray | dict[str, np.ndarray],
    y: np.ndarray,
    weight: np.ndarray,
    users: np.ndarray | None,
    replicas: int,
    rows_per_replica: int | None,
) -> list[tuple]:
    """Split one step's rows over replicas: (x, y, weight, groups) each, a user's rows on one replica
    (user-level), every replica padded with zero-weight rows to `rows_per_replica` when given
    (static shapes for TPUs) or to at least one row. `x` may be a dict of arrays (several inputs)."""
    shards: list[tuple] = []
    owner = (
        np.arange(len(weight)) * replicas // max(len(weight), 1)
        if users is None
        else row_groups(users, len(weight)) % replicas
    )
    for replica in range(replicas):
        mine = owner == replica
        size = rows_per_replica or max(int(mine.sum()), 1)
        if mine.sum() > size:
            raise InputError(f"a step has {int(mine.sum())} rows for one replica, more than the {size} planned")
        pad = size - int(mine.sum())
        groups = row_groups(None if users is None else users[mine], int(mine.sum()))
        shards.append(
            (
                tf.nest.map_structure(functools.partial(_padded, mine, pad), x),
                np.concatenate([y[mine], np.zeros((pad, *y.shape[1:]), y.dtype)]),
                np.concatenate([weight[mine], np.zeros(pad, weight.dtype)]),
                np.concatenate([groups, np.arange(len(groups), len(groups) + pad, dtype=np.int32)]),
            )
        )
    return shards


def _padded(mine: np.ndarray, pad: int, a: np.ndarray) -> np.ndarray:
    return np.concatenate([a[mine], np.zeros((pad, *a.shape[1:]), a.dtype)])


def distribute(strategy, shards: list[tuple]) -> tuple:
    """(x, y, weight, groups) for `strategy.run`: plain tensors on one replica, per-replica values otherwise."""
    if strategy.num_replicas_in_sync == 1:
        return tf.nest.map_structure(tf.constant, shards[0])
    value = strategy.experimental_distribute_values_from_function(
        lambda context: tf.nest.map_structure(tf.constant, shards[context.replica_id_in_sync_group])
    )
    return tuple(value)


def split_over_replicas(strategy, x, y, weight, users: np.ndarray | None, rows_per_replica: int | None) -> tuple:
    """A step's rows as `apply` takes them under `strategy`: split over its replicas (`shard_step`),
    each shard's arrays on its replica (`distribute`)."""
    x = tf.nest.map_structure(np.asarray, x)
    shards = shard_step(x, np.asarray(y), np.asarray(weight), users, strategy.num_replicas_in_sync, rows_per_replica)
    return distribute(strategy, shards)
