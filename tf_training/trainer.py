"""`madp train`: DP-SGD or DP-BandMF on `madp batch` outputs, one training step per materialized step.

Per step: per-example gradients of the weighted loss (padding rows have weight 0, hence zero
gradient), clipped and summed by the DPQuery, noised (z_t or BandMF's C^-1 z), divided by the
*expected* batch size, then handed to the optimizer. The mechanism and its parameters come from
the batches' report and the bounding report, and sigma from the accountant, so the delivered
guarantee describes the data it was trained on. What is checked and built before the first step (the
devices, the model, a resume's checkpoint) is `preparation.py`; here are the loop and its outputs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from typing import Any, NamedTuple

import numpy as np

from madp.core import output_lock, storage
from madp.core.batch_files import USER_FEATURE
from madp.core.errors import InputError, OptionError
from madp.core.options import error_text
from madp.core.progress import Progress
from madp.core.selection import REJECTED_DIR
from madp.training import (  # the public API; the trainer's own parts: tasks, models, options, outputs, long jobs
    Batches,
    NonPrivateStep,
    PrivacyPlan,
    PrivateTrainingStep,
    calibrate,
    load_tensorflow,
    make_non_private,
    make_private,
    open_batches,
    privacy_json,
    read_steps,
)
from madp.training.long_training import (
    Checkpoints,
    CheckpointState,
    ScalarLog,
    epsilon_spent,
    interrupted_state,
    learning_rate_at,
    set_learning_rate,
    step_statistics,
)
from madp.training.options import TrainOptions, training_defaults
from madp.training.outputs import (
    EVALUATION_FIELDS,
    EVALUATION_FILE,
    METRICS_FILE,
    TIMING_FIELDS,
    TIMING_FILE,
    TrainingMetrics,
    TrainingResult,
    checkpoints_directory,
    drop_replaced,
    internal_path,
    replaced_directory,
    set_aside,
    settle_replaced,
    settled_text,
    without_clock_times,
    write_metrics,
    written_by_training,
)
from madp.training.preparation import (
    Built,
    build_model_and_optimizer,
    check_public_eval_data,
    distribution_strategy,
    public_model_assumption,
    resume_point,
    with_public_inputs,
    zero_out_ids,
)
from madp.training.task_rows import NotFinite, finite_evaluation, refuse_non_finite_loss
from madp.training.tasks import CausalLmTask, TextClassifierTask, prepare_task, step_features
from madp.training.user_tasks import MetricsFailed, non_finite_weights, user_model_failures

tf = load_tensorflow()

log = logging.getLogger("madp.train")


def _checked_evaluation(task, model, loss_fn, data, options: TrainOptions, when: str) -> dict:
    """The task's evaluation of the model on --eval-data, every figure a finite number (`finite_evaluation`);
    a module:function model that fails as it runs there is named (`user_model_failures`)."""
    with user_model_failures(options, f"in its evaluation on --eval-data {when}"):
        evaluated = task.evaluate(model, loss_fn, data)
    return finite_evaluation(evaluated, f"--model {options.model}: its evaluation on --eval-data {when}")


class _Logs(NamedTuple):
    """A training's TensorBoard scalars: `published` (epsilon spent, public evaluations; stamped with steps,
    never clock times: see ScalarLog) and `internal` (the scalars of the training rows without noise,
    --internal-scalars, see long_training; the evaluations on data not declared public: no guarantee
    covers either), `evaluations` the one of the two the evaluations go to."""

    published: ScalarLog
    internal: ScalarLog | None
    evaluations: ScalarLog


def _take_output(output: str, replaced: list[str], resumed: int, options: TrainOptions, published_eval: bool) -> _Logs:
    """The logs, opened once this run's first step has run (or none was left to run), after setting aside
    the earlier training's outputs that --replace replaces (`replaced`; `set_aside`): nothing is written into
    OUTPUT before, so a training that fails in its first step leaves it as it was, and one that stops later
    gets them back (`_settled`)."""
    set_aside(output, replaced)
    published = ScalarLog(storage.join(output, "logs"), resumed)
    needs_internal = options.internal_scalars or not published_eval
    internal = ScalarLog(internal_path(output, "logs"), resumed) if needs_internal else None
    return _Logs(published, internal, internal if internal is not None and not published_eval else published)


def _evaluates(done: int, steps: int, options: TrainOptions) -> bool:
    """Whether step `done` (1-based) is an evaluation and logging point."""
    return done % options.eval_every == 0 or done == steps


def _optimizer_fields(own_optimizer, options: TrainOptions) -> dict:
    """What metrics.json says of the optimizer: the one the options build, or the class of the one a
    module:function model returned (its learning rate may be a schedule: the model's code says it);
    and the L2 penalty the steps add, if any."""
    settings = training_defaults(options)
    penalty = {"l2": settings.l2} if settings.l2 else {}
    if own_optimizer is not None:
        return {"optimizer": f"{type(own_optimizer).__qualname__} (the model's own)", **penalty}
    return {
        "optimizer": settings.name,
        "learning_rate": settings.learning_rate,
        **({"adam_epsilon": settings.adam_epsilon} if settings.adam_epsilon else {}),
        **penalty,
    }


def _text_features(task: TextClassifierTask, options: TrainOptions) -> dict:
    """What a text classifier's saved model needs of a new text: its labels' order and the hashed
    n-grams it reads (`text.hashed_ngrams(texts, buckets, max_length, ngrams, prefix=word_prefix)`)."""
    features = {
        "ngrams": options.ngram_order,
        "buckets": options.buckets,
        "max_length": options.max_length,
        "word_prefix": options.word_prefix_length,
    }
    return {"labels": task.labels, "text_features": features}


def _pretrained_fields(task, options: TrainOptions) -> dict:
    """A pretrained model's metrics fields: the adapters' rank and the pretrained model's evaluation
    on --eval-data before the first step (published as the evaluations are: it is the public
    model's, on the same held-out data)."""
    if not isinstance(task, CausalLmTask):
        return {}
    return {"lora_rank": options.lora_rank, "pretrained_eval": task.pretrained_eval}


def _check_trained_model(model, loss_fn, options: TrainOptions, last_rows: tuple | None, entered: bool) -> None:
    """Refuse to publish a trained model whose weights hold NaN or infinite values (a non-private step
    applies a NaN gradient; a learning rate far too high overflows), or, of a `--model module:function`,
    whose loss on the usable rows of the last step is not a number. With the check of its loss before the
    first update (`refuse_non_finite_loss`), that is enough without a check at every step, which would wait
    for the device at each: a private step's update is finite whatever the rows (clipping gives a
    non-finite row no weight, and the noise is finite), so a model whose loss stops being a number on some
    rows meanwhile trains on the others, under the plan's guarantee like any training; what must not be
    published as trained is a model that computes no number, and that is checked on the model as it would
    be published. Each check is one forward pass over one step's rows. `entered`: whether the training is
    in the trainings ledger."""
    kept = "no model.keras or metrics.json is written" + (
        ", and the trainings ledger keeps its entry: its noisy steps ran" if entered else ""
    )
    broken = non_finite_weights(model.trainable_weights)
    if broken:
        raise NotFinite(
            f"--model {options.model}: its weights hold NaN or infinite values after the training "
            f"({', '.join(broken[:3])}): the training diverged (e.g. at too high a --learning-rate); {kept}"
        )
    if options.user_model and last_rows is not None and last_rows[2].any():
        x, y, usable, done = last_rows
        with user_model_failures(options, f"after step {done}"):
            refuse_non_finite_loss(model, loss_fn, x, y, usable, options, f"step {done} after the training", kept)


def train(batches_dir: str, output: str, options: TrainOptions) -> TrainingResult:
    """Train on a `madp batch` output and write model.keras, metrics.json and privacy.json to `output`.
    A private training holds the lock of the selection the batches were made from (which keeps the
    trainings ledger of every batch output made from it) from its plan to its last step (its entry in
    the ledger, made before its first noisy update, is then marked finished), so two trainings on one
    selection (a parallel sweep) run one after the other and the second composes with the first
    instead of both claiming a single training's guarantee. Where the selection is not there, nothing
    is held: a private training is refused then (`make_private`), a seeded one keeps no ledger. A full
    file system is a `DiskFull` naming `output`: TensorFlow's writes (checkpoints, the model) raise
    errors of their own types."""
    started = time.perf_counter()
    _settle(output, batches_dir, stopped=False)
    if options.amplified and options.mc_runner == "cuda" and not options.calibration:
        if tf.config.list_physical_devices("GPU"):  # cupy's arrays would compete with TensorFlow's for it
            raise OptionError(
                "{mc_runner} cuda: TensorFlow trains on this machine's GPU and holds it while madp train "
                "accounts; compute the plan first (madp run's calibrate stage, with mc_runner: cuda) and "
                "train with it ({calibration})"
            )
    batches = open_batches(batches_dir)
    selection = batches.selection
    try:
        with _settled(output, batches_dir):
            if options.mechanism == "none" or not selection or storage.kind(selection) != "directory":
                result = _train(batches, output, options, started)
            else:
                with output_lock.exclusive(
                    selection, f"train {output} (holds the trainings ledger)", keeps_content=True
                ):
                    result = _train(batches, output, options, started)
            return TrainingResult.from_json(result, f"the training into {output}")
    except (OSError, tf.errors.OpError) as error:
        full = storage.disk_full(getattr(error, "filename", None) or output, error)  # the file, where it is known
        if full is None:
            raise
        raise full from error


@contextlib.contextmanager
def _settled(output: str, batches_dir: str):
    """A training that stops before it has finished leaves the training it was replacing (--replace) as
    that was, unless it keeps a checkpoint to resume (`_settle`). One stopped by a model that computes no
    number (`NotFinite`) keeps no checkpoint: its latest holds that model (each evaluation follows one),
    and a resume would evaluate it again and stop there."""
    try:
        yield
    except NotFinite as error:
        held = checkpoints_directory(output)
        removed = storage.kind(held) != "missing"
        storage.remove_tree(held)
        _settle(output, batches_dir, stopped=True)
        if not removed:
            raise
        raise NotFinite(
            f"{error}; its checkpoint ({held}) held this model, which a resume would stop at: removed"
        ) from None
    except BaseException:
        _settle(output, batches_dir, stopped=True)
        raise


def _settle(output: str, batches_dir: str, stopped: bool) -> None:
    """Before a training into OUTPUT and after one that `stopped`: remove a checkpoint folder no resume can
    read (a first checkpoint cut short by a full disk or a kill), then settle an earlier training set aside
    by --replace (`settle_replaced`), said in the log. A failure here is named, never in the way of what
    stopped."""
    try:
        held = checkpoints_directory(output)
        if storage.kind(held) != "missing" and interrupted_state(output, batches_dir) is None:
            log.warning("%s: no resume can read it (its first checkpoint was cut short): removed", held)
            storage.remove_tree(held)
        outcome = settle_replaced(output)
    except Exception as error:  # the files stay where they are (a damaged state: --resume names it)
        aside = replaced_directory(output)
        said = error_text(error)  # a damaged checkpoint state's OptionError, as the command line names it
        log.warning("%s: the training a --replace training set aside in %s is not settled (%s)", output, aside, said)
        return
    if outcome == "restored" or (outcome == "kept" and stopped):
        log.warning("%s", settled_text(output, outcome))


class _Run(NamedTuple):
    """What every step of a training and its outputs read, fixed once the step is made: `privacy` is the
    plan the guarantee states (with the composition of earlier trainings on these batches), `planned` this
    training's own (what a checkpoint must match, and what epsilon spent counts; None without privacy),
    `evaluation` the --eval-data rows, `replaced` the earlier training's outputs --replace sets aside."""

    batches: Batches
    output: str
    options: TrainOptions
    task: Any
    built: Built
    step: NonPrivateStep | PrivateTrainingStep
    privacy: PrivacyPlan | None
    planned: PrivacyPlan | None
    evaluation: Any
    checkpoints: Checkpoints | None
    resumed: int
    replaced: list[str]
    published_eval: bool
    schedule: str
    user_level: bool


@dataclasses.dataclass
class _RunState:
    """What the steps of a run have produced so far: the evaluations (`metrics`, a resumed run's from its
    checkpoint first), the logs (once its first step ran), a task's metrics() that failed (the model trains
    on, unevaluated), whether a module:function model's loss was found finite on a step's usable rows (madp's
    own models: a finite loss on the rows their tasks accept), and (x, y, usable rows, step) of the last step
    this run took: the trained model's check."""

    metrics: list[dict]
    loss_checked: bool
    scalars: _Logs | None = None
    unevaluated: MetricsFailed | None = None
    last_rows: tuple | None = None


def _train(batches: Batches, output: str, options: TrainOptions, started: float) -> dict:
    """`train` inside its lock and settlement: the checks, the model, the plan and the step, then the steps
    (`_run_steps`) and the outputs (`_write_outputs`); returns what `madp train` prints."""
    batches_dir = batches.directory
    if options.eval_data and options.eval_data_public:
        check_public_eval_data(options.eval_data, batches)
    public_model = public_model_assumption(options)
    # The devices first: TensorFlow fixes them when it first runs an op, and prepare_task reads every step
    strategy = distribution_strategy(options)
    task, skipped = prepare_task(options, batches)
    built = build_model_and_optimizer(task, strategy, options)
    interrupted = resume_point(batches_dir, output, options)
    # --replace: an earlier training's outputs, replaced once this one has taken its first step (every check
    # passed, the model traced and ran); files madp does not write are refused here, before the plan is computed.
    replaced = []
    if options.replace and interrupted is None:
        replaced = storage.written_files(output, written_by_training, "madp train")
    resumed, training = (0, None) if interrupted is None else (interrupted.step, interrupted.training)
    needs_checkpoints = options.checkpoint_every or resumed
    user_level = batches.report.sampler == "users"
    privacy = None if options.mechanism == "none" else calibrate(batches, options)  # None: non-private
    if privacy is not None:
        privacy = with_public_inputs(privacy, task, options, public_model)
    step = _training_step(
        batches, output, options, built, strategy, privacy, resumed, training, bool(needs_checkpoints)
    )
    if isinstance(step, PrivateTrainingStep):
        privacy = step.plan  # with the composition of earlier trainings on these batches, if any
    built = built._replace(loss_fn=step.loss_fn)  # for evaluations and statistics too: outputs taken in float32
    evaluation = task.read_eval(options.eval_data) if options.eval_data else None
    if evaluation is not None and options.user_model:  # the user's model, loss and metrics() run once on the
        # evaluation data before anything trains: one that raises, or gives no finite numbers, stops here
        _checked_evaluation(task, built.model, built.loss_fn, evaluation, options, "before the first step")
    checkpoints = Checkpoints(output, built.model, built.optimizer, step, options) if needs_checkpoints else None
    run = _Run(
        batches=batches,
        output=output,
        options=options,
        task=task,
        built=built,
        step=step,
        privacy=privacy,
        planned=step.own_plan if isinstance(step, PrivateTrainingStep) else None,
        evaluation=evaluation,
        checkpoints=checkpoints,
        resumed=resumed,
        replaced=replaced,
        published_eval=options.eval_data_public or evaluation is None,
        schedule=training_defaults(options).lr_schedule,
        user_level=user_level,
    )
    state = _RunState(_resumed_metrics(run, interrupted), loss_checked=not options.user_model)
    loop_started = time.perf_counter()
    _run_steps(run, state)
    entered = isinstance(step, PrivateTrainingStep) and step.ledger is not None
    _check_trained_model(built.model, built.loss_fn, options, state.last_rows, entered)
    built.model.save(storage.join(output, "model.keras"))  # TensorFlow's file systems: local, gs://, s3://, hdfs://
    without_clock_times(storage.join(output, "model.keras"))  # Keras stamps it with the time it was saved
    result = _result(run, strategy.num_replicas_in_sync, state.metrics, started, loop_started)
    _write_outputs(run, state, result, skipped)
    return result


def _training_step(
    batches: Batches,
    output: str,
    options: TrainOptions,
    built: Built,
    strategy,
    privacy: PrivacyPlan | None,
    resumed: int,
    training: str | None,
    releases_from_checkpoints: bool,
) -> NonPrivateStep | PrivateTrainingStep:
    """The step that trains the model on one step's rows: private under `privacy` (which enters the trainings
    ledger), or non-private without it."""
    # Several replicas get fixed-size shards (one trace; static shapes for TPUs) of the largest step;
    # so does an XLA step, which compiles once per shape.
    fixed = options.distribution != "default" or options.xla
    replicas = strategy.num_replicas_in_sync
    rows_per_replica = -(-max(batches.max_rows_per_step, 1) // replicas) if fixed else None
    l2 = training_defaults(options).l2
    if privacy is None:
        return make_non_private(
            built.model,
            built.loss_fn,
            built.optimizer,
            strategy=strategy,
            rows_per_replica=rows_per_replica,
            jit_compile=options.xla,
            l2=l2,
        )
    return make_private(
        built.model,
        built.loss_fn,
        built.optimizer,
        privacy,
        noise_seed=options.noise_seed,
        strategy=strategy,
        rows_per_replica=rows_per_replica,
        jit_compile=options.xla,
        testing_noise_scale=options.testing_only_noise_scale,
        resumed_at=resumed,
        training=training,
        output=output,
        retrain=options.retrain,
        # With checkpoints, one precedes every evaluation, and a resume takes the latest.
        releases_from_checkpoints=releases_from_checkpoints,
        l2=l2,
    )


def _resumed_metrics(run: _Run, interrupted: CheckpointState | None) -> list[dict]:
    """The evaluations a run starts from: none for a fresh run; a resumed one restores its checkpoint and
    takes its evaluations, with that of the restored step where the interrupted run stopped before it."""
    if run.checkpoints is None or interrupted is None:
        return []
    checkpoints, resumed, steps = run.checkpoints, run.resumed, run.batches.steps
    checkpoints.restore(interrupted, run.planned)
    metrics = list(interrupted.evaluations)
    log.info("resumed at step %d of %d from %s (a fresh noise key)", resumed, steps, checkpoints.directory)
    missed = not metrics or metrics[-1]["step"] != resumed
    if run.evaluation is not None and _evaluates(resumed, steps, run.options) and missed:
        # interrupted between a checkpoint and its evaluation: evaluate the model restored at that step
        metrics.append({"step": resumed, **_evaluation_at(run, f"at step {resumed}")})
    return metrics


def _evaluation_at(run: _Run, when: str) -> dict:
    """The task's checked evaluation of the model as it is now on --eval-data (`_checked_evaluation`)."""
    return _checked_evaluation(run.task, run.built.model, run.built.loss_fn, run.evaluation, run.options, when)


def _run_steps(run: _Run, state: _RunState) -> None:
    """Every step from the one resumed at, each followed by its logs, checkpoint and evaluation; then the
    logs closed (opened, setting the replaced training aside, where no step was left to run)."""
    batches, options = run.batches, run.options
    progress = Progress(log, "training", batches.steps, "steps")
    zeroed = zero_out_ids(options.zero_out) if options.zero_out else None
    for index, rows in enumerate(read_steps(batches, step_features(run.task, batches))):
        if index < run.resumed:  # run before the checkpoint resumed from
            continue
        # Every step runs, an empty one too: its noise is part of the mechanism.
        done = index + 1
        statistics, rate = _take_step(run, state, index, rows, zeroed)
        _after_step(run, state, done, statistics, rate)
        progress.update(done, _quality(run, state.metrics))
    if state.scalars is None:  # no step was left to run: resumed after the last
        state.scalars = _take_output(run.output, run.replaced, run.resumed, options, run.published_eval)
    state.scalars.published.close()
    if state.scalars.internal is not None:
        state.scalars.internal.close()


def _take_step(run: _Run, state: _RunState, index: int, rows: dict, zeroed: np.ndarray | None) -> tuple[dict, float]:
    """Step `index` on its rows: the rows a task cannot use (and --zero-out's) weighted 0, the schedule's
    learning rate set, a module:function model's loss checked before the first update, and, at a logging
    point with --internal-scalars, the rows' statistics before the update (no noise: INTERNAL). Returns the
    statistics and the learning rate (NaN for a constant rate, which is not logged)."""
    batches, options, model, loss_fn = run.batches, run.options, run.built.model, run.built.loss_fn
    done = index + 1
    x, y, problems = run.task.encode(rows)
    weight = np.where(problems == "", rows["weight"], 0).astype(np.float32)  # skipped rows: none unless asked
    if zeroed is not None:  # the zero-out neighbour: these rows stay in the step with zero gradient
        weight = np.where(np.isin(rows["id"], zeroed), np.float32(0), weight)
    rate = float("nan")
    if run.schedule != "constant":  # by step index: public
        rate = learning_rate_at(index, batches.steps, options)
        set_learning_rate(run.built.optimizer, rate)
    logs = _evaluates(done, batches.steps, options)
    users = rows[USER_FEATURE] if run.user_level else None
    statistics = {}  # INTERNAL: the step's rows before its update, no noise
    usable = weight > 0
    with user_model_failures(options, f"at step {done}"):
        if not state.loss_checked and usable.any():  # before the first update (see _check_trained_model)
            refuse_non_finite_loss(model, loss_fn, x, y, usable, options, f"step {done}", "this step did not run")
            state.loss_checked = True
        if options.internal_scalars and logs:
            statistics = step_statistics(model, loss_fn, x, y, weight, users, options.clip_norm)
        run.step(x, y, weight, users=users, index=rows["step"])
    state.last_rows = (x, y, usable, done)
    return statistics, rate


def _after_step(run: _Run, state: _RunState, done: int, statistics: dict, rate: float) -> None:
    """What follows step `done`: the output taken (after the first step this run took), its scalars logged,
    its checkpoint, then its evaluation and epsilon spent (published after the checkpoint)."""
    batches, options = run.batches, run.options
    logs = _evaluates(done, batches.steps, options)
    if state.scalars is None:
        state.scalars = _take_output(run.output, run.replaced, run.resumed, options, run.published_eval)
    scalars = state.scalars
    if run.schedule != "constant" and logs:  # public: the schedule's value
        scalars.published.scalar("train/learning_rate", rate, done)
    if scalars.internal is not None:
        for name, value in statistics.items():
            scalars.internal.scalar(f"train/{name}", value, done)
    evaluates = logs and run.evaluation is not None and state.unevaluated is None
    every = options.checkpoint_every
    if run.checkpoints is not None and ((every and done % every == 0) or evaluates or done == batches.steps):
        # Before anything of this step is published (its evaluation): a resumed run never re-does a
        # step whose model was released, so no step is released twice with different noise.
        # A copy of an older checkpoint may not continue once the ledger records this one. The last
        # step's lets a run stopped while writing its outputs write them on --resume, running no step.
        run.checkpoints.save(done, state.metrics, run.planned, run.step.checkpointed)
    if evaluates:
        try:
            state.metrics.append({"step": done, **_evaluation_at(run, f"at step {done}")})
        except MetricsFailed as error:
            state.unevaluated = MetricsFailed(f"{error} (at step {done})")
        else:
            for name in ("loss", run.task.headline):
                scalars.evaluations.scalar(f"eval/{name}", state.metrics[-1][name], done)
    if run.privacy is not None and logs:  # public: a function of the plan and the step count only
        scalars.published.scalar("privacy/epsilon_spent", epsilon_spent(run.planned or run.privacy, done), done)


def _quality(run: _Run, metrics: list[dict]) -> str:
    """The progress line's latest evaluation, said internal where no guarantee or declaration covers it."""
    headline = run.task.headline
    quality = f", eval {headline} {metrics[-1][headline]:.4f}" if metrics else ""
    if quality and run.privacy is None:  # no guarantee covers these figures: the line says so
        quality += " (non-private: internal)"
    elif quality and not run.published_eval:
        quality += " (--eval-data not declared public: internal)"
    return quality


def _result(run: _Run, replicas: int, metrics: list[dict], started: float, loop_started: float) -> dict:
    """What `madp train` prints: metrics.json's fields, the timings and the privacy plan."""
    batches, options, schedule = run.batches, run.options, run.schedule
    return {
        "batches": batches.directory,
        "output": run.output,
        "steps": batches.steps,
        "model": options.model,
        "distribution": options.distribution,
        "replicas": replicas,
        "xla": options.xla,
        "mixed_precision": options.mixed_precision,
        **_optimizer_fields(run.built.own_optimizer, options),
        "lr_schedule": schedule,
        **({"warmup_steps": options.warmup_steps} if schedule == "warmup-cosine" else {}),
        **({"resumed_at": run.resumed} if run.resumed else {}),
        "seed": options.seed,
        "eval_data_public": options.eval_data_public,  # whether the evaluations below may be published
        **(_text_features(run.task, options) if isinstance(run.task, TextClassifierTask) else {}),
        **_pretrained_fields(run.task, options),
        "eval": metrics,
        "final": metrics[-1] if metrics else None,
        "wall_time_s": round(time.perf_counter() - started, 3),
        "steps_per_s": round((batches.steps - run.resumed) / (time.perf_counter() - loop_started), 2),
        "privacy": privacy_json(run.privacy),
    }


def _write_outputs(run: _Run, state: _RunState, result: dict, skipped) -> None:
    """The trained model's files beside model.keras: the evaluations (internal where --eval-data is not
    declared public), the timings (internal), metrics.json, the rejected rows (internal) and privacy.json
    last; then the replaced training and the checkpoints are deleted. `result` gets the internal files'
    notes. A metrics() that failed is raised last, once the model and its guarantee are written."""
    output, unevaluated = run.output, state.unevaluated
    if not run.published_eval and unevaluated is None:  # computed without noise on records no guarantee covers:
        # internal only, not in metrics.json nor in what madp train prints (`evaluation_of(OUTPUT, internal=True)`)
        kept = internal_path(output, EVALUATION_FILE)
        evaluations = {field: result.pop(field) for field in EVALUATION_FIELDS if field in result}
        storage.write_text(kept, json.dumps(evaluations, indent=2, allow_nan=False))
        result["evaluation"] = f"{kept} (internal: --eval-data was not declared public with --eval-data-public)"
    # Timings depend on the realized (secret) sampling and the rows' content, which no guarantee covers
    timing = {field: result[field] for field in TIMING_FIELDS}
    storage.write_text(internal_path(output, TIMING_FILE), json.dumps(timing, indent=2, allow_nan=False))
    published = {k: v for k, v in result.items() if k != "privacy" and k not in TIMING_FIELDS}
    if unevaluated is None:  # else no evaluation to publish with the model: no metrics.json
        write_metrics(output, TrainingMetrics.from_json(published, storage.join(output, METRICS_FILE)))
    if len(skipped):  # which records a task could not use, and in how many steps: internal, never published
        storage.write_text(storage.join(output, REJECTED_DIR, "rejected.jsonl"), skipped.to_jsonl())
        storage.write_text(storage.join(output, REJECTED_DIR, "counts.json"), json.dumps(skipped.counts(), indent=2))
        result["rejected"] = f"{storage.join(output, REJECTED_DIR)}: rows trained with weight 0 (internal)"
    # privacy.json last, then the training it replaced (set aside) is deleted; a run stopped before resumes from
    # the last step's checkpoint, removed only now, to write them
    privacy_text = json.dumps(result["privacy"], indent=2, default=list, allow_nan=False)
    storage.write_text(storage.join(output, "privacy.json"), privacy_text)
    drop_replaced(output)
    if run.checkpoints is not None:  # done: the secret noise history has no further use
        storage.remove_tree(run.checkpoints.directory)
    if unevaluated is not None:  # the model trained and is kept, with its guarantee; its evaluation failed
        raise InputError(
            f"{unevaluated}; the training ran all its steps: {storage.join(output, 'model.keras')} and privacy.json "
            f"hold its model and guarantee, and no metrics.json is written: fix metrics() and evaluate model.keras"
        )
