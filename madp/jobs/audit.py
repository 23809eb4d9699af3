"""`madp audit CONFIG.yaml`: an empirical lower bound on the epsilon of the model a config trains,
from one extra training run with planted canary users (one-run auditing).

m canary users join the job's records. Each owns one record of random content (a random feature
pattern and label), and half of them also share a record with another canary. Every canary is
included independently with probability 1/2. Under our neighbouring relation (fixed-graph
zero-out) "excluded" means its records keep their place in the graph but have zero gradient, so
all canary records go through bounding and batching exactly as real records do, and training
gives the excluded canaries' rows weight 0 (`madp train --zero-out`). The audit then scores each
canary by the trained model's loss on its records, guesses the lowest losses "included" and the
highest "excluded", and turns the correct guesses into a lower bound on epsilon
(`madp.accounting.auditing`). A bound above the claimed epsilon refutes the claim: the audit fails.

Everything is written under `run_dir/audit/` (or `--output`): its own records, selection, batches
and model. The job's own outputs are never touched.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa

from madp.accounting.auditing import one_run_audit
from madp.core import output_lock, storage
from madp.core.errors import CheckFailed, InputError
from madp.core.randomness import SecretKey
from madp.core.record_reading import content_columns, read_file
from madp.core.records import INPUT_SUFFIXES, Columns, list_input_files
from madp.core.reports import AuditReport, CanaryScore
from madp.core.user_ids import EMAIL
from madp.jobs import run, run_config, run_plan, run_steps
from madp.tools.planning.audit_config import AuditOptions, audit_directory
from madp.training.options import TrainOptions
from madp.training.plan import PrivacyPlan, stated_plan

log = logging.getLogger("madp.audit")
AUDIT_FILE = "audit.json"
CANARY_FILE = "canaries.parquet"
ZERO_OUT_FILE = "zero-out.json"


# --- canaries -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Canaries:
    users: list  # the m canary user ids
    included: np.ndarray  # bool [m]
    record_ids: list  # canary record ids
    owners: list[tuple[int, ...]]  # indices into `users` of each record's users
    table: pa.Table  # the canary records, in the real records' schema


# The largest canary feature norm whose example's gradient keeps a finite squared norm in float32: a
# Dense layer's is ||a||^2 ||d||^2, and under a squared-error loss the output gradient d grows with a,
# so the square grows as ||a||^4 (at 1e10 clipping gave such canaries no weight).
FLOAT32_NORM_LIMIT = float(np.finfo(np.float32).max) ** 0.25


def plant(
    real_files: list[str], columns: Columns, features: str, label: str, options: AuditOptions, rng: np.random.Generator
) -> Canaries:
    """m canary users and their records, with ids no real record or user has, and content of the
    real records' types: features of norm `canary_norm` x the real median, labels drawn from the real ones."""
    ids, users, sample = _real_ids(real_files, columns)
    names = tuple(sample.column_names)
    if features not in names or label not in names:
        raise InputError(
            f"the audit plants canaries in the content columns {features!r} and {label!r} "
            f"(the train section's features and label), but {real_files[0]} has {list(names)}"
        )
    m = options.canaries
    # read as e-mail addresses (--user-ids email), a canary user must be one, or its records were bad_address
    canary_users = _fresh_ids(users, m, "madp-canary-user-", "@canary.invalid" if columns.user_ids == EMAIL else "")
    pairs = rng.permutation(m)[: 2 * int(options.shared * m / 2)].reshape(-1, 2)
    owners = [(i,) for i in range(m)] + [tuple(sorted(int(u) for u in pair)) for pair in pairs]
    record_ids = _fresh_ids(ids, len(owners), "madp-canary-record-")
    width = len(sample.column(features)[0])
    norms = np.linalg.norm(np.stack(sample.column(features).to_numpy(zero_copy_only=False)), axis=1)
    median = float(np.median(norms) or 1.0)
    if not np.isfinite(median):
        raise InputError(
            f"the real records' {features!r} column holds NaN or infinite values (their median norm is {median}): "
            f"the audit scales its canaries by that median; fix or drop those records"
        )
    norm = options.canary_norm * median
    if not norm < FLOAT32_NORM_LIMIT:
        raise InputError(
            f"--canary-norm {options.canary_norm:g}: canary features of norm {norm:.3g} ({options.canary_norm:g} x "
            f"the real records' median feature norm {median:.3g}) are beyond {FLOAT32_NORM_LIMIT:.3g}, where an "
            f"example's squared gradient norm can overflow float32, in which the model trains: clipping would give "
            f"them no weight and the audit would measure nothing; use a smaller --canary-norm (default 10)"
        )
    pattern = _canary_patterns(rng, m, len(owners) - m, width) * norm
    labels = np.asarray(sample.column(label).to_numpy(zero_copy_only=False))
    chosen = rng.choice(np.unique(labels), size=len(owners))
    table = _content_table(sample, names, features, label, pattern, chosen, len(owners))
    table = table.append_column(columns.id, pa.array(record_ids, type=ids.type))
    user_lists = pa.array([[canary_users[i] for i in o] for o in owners], type=pa.list_(users.type))
    for index, name in enumerate(columns.user_sources):  # --users-columns: all in the first, the others null
        table = table.append_column(name, user_lists if index == 0 else pa.nulls(len(owners), user_lists.type))
    included = rng.random(m) < 0.5
    return Canaries(users=canary_users, included=included, record_ids=record_ids, owners=owners, table=table)


def _canary_patterns(rng: np.random.Generator, own: int, shared: int, width: int) -> np.ndarray:
    """Unit-norm random feature patterns: the `own` records' mutually orthogonal where width allows (a random
    orthonormal basis: one canary's gradient then has no component along another's in a linear model), the
    `shared` records' random signs."""
    if own <= width:
        basis, _ = np.linalg.qr(rng.normal(size=(width, own)))
        first = basis.T
    else:
        first = rng.choice([-1.0, 1.0], size=(own, width)) / np.sqrt(width)
    rest = rng.choice([-1.0, 1.0], size=(shared, width)) / np.sqrt(width)
    return np.concatenate([first, rest])


def _real_ids(files: list[str], columns: Columns) -> tuple[pa.Array, pa.Array, pa.Table]:
    """Every real record id and user id (to pick fresh ones), and the content of the first file's records."""
    chunks = [
        read_file(path, index, columns, content_columns(path, columns) if index == 0 else None).chunk
        for index, path in enumerate(files)
    ]
    if len(chunks[0]) == 0:
        raise InputError(f"{files[0]}: no valid record to take the content types from")
    return (
        pa.chunked_array([c.ids for c in chunks]).combine_chunks(),
        pa.chunked_array([c.users for c in chunks]).combine_chunks(),
        chunks[0].content,
    )


def _fresh_ids(taken: pa.Array, count: int, prefix: str, suffix: str = "") -> list:
    """`count` ids of `taken`'s type that `taken` does not hold: integers above its largest, or strings
    `prefix` + a number + `suffix`."""
    if pa.types.is_integer(taken.type):
        start = int(max(taken.to_numpy().max(initial=-1), -1)) + 1
        return list(range(start, start + count))
    existing = set(taken.to_pylist())
    names = [f"{prefix}{i}{suffix}" for i in range(count)]
    clash = [n for n in names if n in existing]
    if clash:
        raise InputError(f"the records already use the canary id {clash[0]!r}; rename it to run an audit")
    return names


def _content_table(
    sample: pa.Table,
    names: tuple[str, ...],
    features: str,
    label: str,
    pattern: np.ndarray,
    labels: np.ndarray,
    rows: int,
) -> pa.Table:
    arrays = {}
    for name in names:
        kind = sample.schema.field(name).type
        if name == features:
            flat = pa.array(pattern.ravel(), type=kind.value_type)
            arrays[name] = (
                pa.FixedSizeListArray.from_arrays(flat, pattern.shape[1])
                if pa.types.is_fixed_size_list(kind)
                else pa.ListArray.from_arrays(pa.array(np.arange(rows + 1) * pattern.shape[1], pa.int32()), flat)
            ).cast(kind)
        elif name == label:
            arrays[name] = pa.array(labels.tolist(), type=kind)
        else:
            arrays[name] = pa.nulls(rows, type=kind)
    return pa.table(arrays)


def _zeroed_records(canaries: Canaries) -> list:
    """Ids of the canary records with an excluded owner: the zero-out neighbour replaces them."""
    return [
        rid
        for rid, owners in zip(canaries.record_ids, canaries.owners)
        if not all(canaries.included[i] for i in owners)
    ]


def _canary_scores(losses: np.ndarray, canaries: Canaries) -> np.ndarray:
    """Each canary's score: minus the mean loss of its records (a memorized canary has a low loss)."""
    total = np.zeros(len(canaries.users))
    count = np.zeros(len(canaries.users))
    for loss, owners in zip(losses, canaries.owners):
        for i in owners:
            total[i] += loss
            count[i] += 1
    return -total / count


# --- the audit job ------------------------------------------------------------------------------


def run_audit(config_path: str, overrides: list[str], given: Mapping[str, Any], force: bool = False) -> dict:
    """The audit of a config's model (`given`: the audit's options from the command line, None where not
    given): its job (with canaries planted) planned and run."""
    config = run_config.RunConfig.read(config_path, overrides)
    options = run_config.audited(config, given)
    planned = run_plan.stages_of(config)  # the job itself must be valid
    directory = audit_directory(config.run_dir, options)
    with output_lock.exclusive(directory, f"audit {config_path}"):
        return _audit(config_path, config, planned, options, directory, force)


def _audit(
    config_path: str,
    config: run_config.RunConfig,
    planned: list[run_plan.Stage],
    options: AuditOptions,
    directory: str,
    force: bool,
) -> dict:
    """The audit job, in `directory`, of the config whose stages are `planned`."""
    path = lambda name: storage.join(directory, name)  # noqa: E731
    key = SecretKey.for_run(options.seed, "audit canaries", "--seed")
    rng = np.random.default_rng(list(key.words))
    bound, calibrate = run_plan.step_of(planned, run_steps.Bound), run_plan.step_of(planned, run_steps.Calibrate)
    trained = run_plan.step_of(planned, run_steps.Train)  # the train stage's, planned before the baseline's
    assert bound and calibrate and trained and config.train  # `run_config.audited` requires their sections
    real = config.input
    eval_data = None
    if real is None:  # generate the same records into the audit's own directory
        generated = run_config.RunConfig(run_dir=directory, generate=config.generate)
        run.run_stages(directory, config_path, run_plan.stages_of(generated), force)
        real = path("records")
        eval_data = path("test.parquet") if config.generate and config.generate.holdout else None
    real_files = list_input_files(real)
    features, label = trained.options.features, trained.options.label
    canaries = plant(real_files, bound.options.columns, features, label, options, rng)
    inputs = path("input")
    storage.clear_directory(inputs)
    for index, source in enumerate(real_files):
        suffix = next(s for s in INPUT_SUFFIXES if source.endswith(s))
        storage.link_or_copy(source, storage.join(inputs, f"records-{index:05d}{suffix}"))
    storage.write_parquet(canaries.table, storage.join(inputs, CANARY_FILE))
    storage.write_text(path(ZERO_OUT_FILE), json.dumps(_zeroed_records(canaries)))

    train = config.train
    if eval_data and "eval_data" not in train.names:
        train = train.with_options((("eval_data", eval_data),))
    train = train.with_options((("zero_out", path(ZERO_OUT_FILE)),))
    if options.testing_noise_scale != 1.0:
        train = train.with_options((("testing_only_noise_scale", options.testing_noise_scale),))
    job = dataclasses.replace(
        config,
        run_dir=directory,
        input=inputs,
        generate=None,
        train=dataclasses.replace(train, baseline=options.non_private),
        audit=None,
        report=False,
    )
    stages = [
        s
        for s in run_plan.stages_of(job)
        if s.name not in (("calibrate", "train") if options.non_private else ("baseline",))
    ]
    run.run_stages(directory, config_path, stages, force)

    model_dir = path("baseline" if options.non_private else "train")
    audited = next(s.step for s in stages if s.name in ("train", "baseline"))
    assert isinstance(audited, run_steps.Train)
    scores = _canary_scores(_losses(model_dir, audited.batches, audited.options, canaries), canaries)
    plan = stated_plan(json.loads(storage.read_text(storage.join(model_dir, "privacy.json"))))
    # The claim's delta (truncation included); the calibrate section's for a non-private audit model.
    delta = float(plan.delta if plan else calibrate.options.delta)
    result = one_run_audit(scores, canaries.included, delta, options.confidence)
    return _write(directory, config_path, options, key, canaries, scores, result, plan)


def _losses(model_dir: str, batches_dir: str, train_options: TrainOptions, canaries: Canaries) -> np.ndarray:
    """Each canary record's loss under the trained model, built for the batches as it trained."""
    from madp.training.batches import open_batches
    from madp.training.tasks import NumericTask

    task = NumericTask(train_options, open_batches(batches_dir).schema.features)
    model, loss_fn = task.trained(model_dir)
    columns = {name: canaries.table.column(name).to_pylist() for name in task.names}
    x, y, _ = task.encode({**columns, "weight": np.ones(canaries.table.num_rows)})
    return np.asarray(loss_fn(y, model(x, training=False)), dtype=np.float64)


def _write(
    directory: str,
    config_path: str,
    options: AuditOptions,
    key: SecretKey,
    canaries: Canaries,
    scores: np.ndarray,
    result,
    plan: PrivacyPlan | None,
) -> dict:
    claimed = plan.epsilon if plan else None
    refuted = claimed is not None and result.epsilon_lower_bound > claimed
    if claimed is not None and claimed >= result.measurable:
        log.warning(
            "the audit cannot refute epsilon %.3g: with %d canaries it measures at most %.3g; "
            "plant more canaries (--canaries) for a sharper audit",
            claimed,
            result.canaries,
            result.measurable,
        )
    audit = AuditReport(
        config=config_path,
        output=directory,
        canaries=result.canaries,
        canary_records=len(canaries.record_ids),
        shared_records=sum(len(o) > 1 for o in canaries.owners),
        included=int(canaries.included.sum()),
        guesses=result.guesses,
        correct_guesses=result.correct,
        epsilon_lower_bound=round(result.epsilon_lower_bound, 4),
        confidence=result.confidence,
        largest_measurable_epsilon=round(result.measurable, 4),
        delta=result.delta,
        claimed_epsilon=claimed,
        mechanism=plan.mechanism if plan else "none",
        noise_multiplier=plan.noise_multiplier if plan else None,
        noise=plan.noise if plan else None,
        non_private=options.non_private,
        testing_noise_scale=options.testing_noise_scale,
        can_refute_claim=claimed is not None and claimed < result.measurable,
        audit_model_private=bool(plan and plan.private),
        inclusion=key.status,
        candidates=tuple(candidate.to_json() for candidate in result.candidates),
        ok=not refuted,
        verdict=(
            "REFUTED: the measured lower bound exceeds the claimed epsilon"
            if refuted
            else "no claim to check (non-private model)"
            if claimed is None
            else "consistent: the measured lower bound does not exceed the claimed epsilon"
        ),
        per_canary=tuple(
            CanaryScore(user, bool(included), round(float(score), 6))
            for user, included, score in zip(canaries.users, canaries.included, scores)
        ),
    )
    storage.write_text(storage.join(directory, AUDIT_FILE), json.dumps(audit.to_json(), indent=2))
    log.info(
        "audit: %d of %d guesses correct on %d canaries: epsilon >= %.3f at %.0f%% confidence (claimed %s)",
        result.correct,
        result.guesses,
        result.canaries,
        result.epsilon_lower_bound,
        100 * result.confidence,
        claimed,
    )
    if refuted:
        raise CheckFailed(
            f"the audit refutes the claimed guarantee: epsilon >= {result.epsilon_lower_bound:.3f} "
            f"at {100 * result.confidence:.0f}% confidence, above the claimed {claimed} "
            f"(delta {result.delta:g}); see {storage.join(directory, AUDIT_FILE)}",
            {**audit.summary(), "per_canary": [one.to_json() for one in audit.per_canary]},
        )
    return audit.summary()
