"""`madp run CONFIG.yaml`, checking: before the bound stage runs, whether the batches the config asks
for can be formed on the input's graph, and whether calibration will accept their truncation; an
infeasible plan stops there with the option to change and a value that works, rather than in
`madp batch` (or calibration) after the bounding.

The check is `madp recommend-k`'s for one k (`madp.tools.planning.feasibility.job_feasibility`): the local
engine's bounding kernels on the graph read into memory, then the sampler's own calibration of p and
the trainer's own truncation delta. The graph is public under the fixed-graph model, so it costs no
privacy.
"""

from __future__ import annotations

import logging

from madp.core import storage
from madp.core.errors import InputError
from madp.core.record_reading import missing_columns
from madp.core.records import list_input_files
from madp.engines.batching import BatchOptions
from madp.jobs.run_plan import Stage, step_of
from madp.jobs.run_steps import Batch, Bound, Calibrate, Train
from madp.stages.arguments import LOCAL
from madp.tools.planning.feasibility import CONFIG_KEYS, BatchTarget, job_feasibility
from madp.training.options import TrainOptions

log = logging.getLogger("madp.run")
# Runners that bound on this machine, where the graph fits in memory; a cluster job's input may not.
IN_PROCESS_RUNNERS = (LOCAL, "DirectRunner")


def check_columns(stages: list[Stage]) -> None:
    """Refuse, before the first stage after generate, a config whose training reads a column that the records
    (the batch stage's DATA) or its evaluation data lack, or that the batch stage's --content-columns leaves
    out: it would fail only after bounding, verifying, batching and calibrating. A --task names its columns in
    its code: the trainer checks those against the batches."""
    batch = step_of(stages, Batch)
    if batch is None:
        return
    data = list_input_files(batch.data)[0]
    for name, training in ((stage.name, stage.step) for stage in stages):  # train, and baseline
        if not isinstance(training, Train):
            continue
        options = training.options
        needed = options.batch_features
        if needed is None:
            continue
        carried = batch.options.content_columns
        if carried is not None and (left_out := [c for c in needed if c not in carried]):
            raise InputError(
                f"config: the {name} section's model {options.model} reads {', '.join(left_out)}, which the batch "
                f"section's content_columns ({','.join(carried)}) leave out of the batches"
            )
        for role, path in (("records", data), ("evaluation data", options.eval_data)):
            if path is None:
                continue
            first = list_input_files(path)[0] if storage.kind(path) == "directory" else path
            missing = missing_columns(first, needed)
            if missing:
                raise InputError(
                    f"config: the {name} section's model {options.model} reads the column(s) "
                    f"{', '.join(missing)}, which the {role} {first} lack: name the column(s) it holds "
                    f"(features, label, text_column)"
                )


def check_feasible(stages: list[Stage]) -> None:
    """Refuse, before bounding, a config whose batches cannot be formed or whose truncation calibration
    would refuse; a plan without a bound and a b-min-sep Poisson batch stage has nothing to check."""
    bound, batch, calibrate = step_of(stages, Bound), step_of(stages, Batch), step_of(stages, Calibrate)
    if bound is None or batch is None:
        return
    if batch.options.sampler != "minsep":  # the greedy and user sampling check their own sizes as they start
        return
    if bound.runner not in IN_PROCESS_RUNNERS:
        log.info(
            "runner %s: the batch-size check before bounding is skipped (it reads the graph into this "
            "process); `madp recommend-k` on a machine that holds the graph checks the same",
            bound.runner,
        )
        return
    options = bound.options
    target = _target(batch.options, None if calibrate is None else calibrate.options)
    log.info(
        "checking the plan on the input's graph: k = %d, batches of %g at min-sep %d",
        options.max_contributions,
        target.batch_size,
        target.min_sep,
    )
    found = job_feasibility(bound.input, options, target)
    if found is not None and not found.feasible:
        raise InputError(
            f"config: this plan cannot run on {bound.input} (checked on its graph, before bounding): "
            + "; ".join(found.problems)
        )


def _target(batch: BatchOptions, calibrate: TrainOptions | None) -> BatchTarget:
    """What the batch and calibrate stages ask: truncation is accounted where `madp train` accounts it,
    amplified DP-SGD on Poisson batches (min-sep 1, one band) or BandMF with --amplified, at the
    target epsilon (a given sigma's epsilon is not known before calibration, which checks it itself)."""
    accounted = calibrate is not None and calibrate.mechanism != "none"
    if calibrate is not None and not calibrate.amplified:
        poisson = batch.min_sep == 1 and calibrate.bands == 1
        accounted = accounted and calibrate.mechanism in ("auto", "dpsgd") and poisson
    return BatchTarget(
        steps=batch.steps,
        batch_size=batch.batch_size,
        min_sep=batch.min_sep,
        delta=calibrate.delta if calibrate is not None else 1.0,
        epsilon=calibrate.epsilon if calibrate is not None else None,
        accounts_truncation=accounted,
        max_batch_size=batch.max_batch_size,
        bands=calibrate.bands if calibrate is not None else 1,
        names=CONFIG_KEYS,
    )
