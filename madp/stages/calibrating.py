"""The calibration step: the privacy plan of training on a batch output (`madp run`'s calibrate stage)."""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any

from madp.core import storage
from madp.stages.arguments import options_of
from madp.training.options import TrainOptions

if TYPE_CHECKING:  # madp.training.plan imports the accountant (dp_accounting) when calibrating
    from madp.training.plan import PrivacyPlan


def calibrate(batches: str, output: str | None = None, **options: Any) -> PrivacyPlan | None:
    """The privacy plan of training on `batches`: the mechanism, sigma and the (epsilon, delta) guarantee.

    What `madp run`'s calibrate stage computes (and `madp train --calibration` trains with): the mechanism
    the batches' report implies (DP-SGD, BandMF, DP-SGD over users, or with `amplified` BandMF with
    b-min-sep sampling, Monte Carlo accounted), sigma calibrated to `epsilon` (or `epsilon` of a given
    `noise_multiplier`), and epsilon at sigma/2 to 2 sigma for the report. Unlike
    `madp.training.calibrate`, it takes the batch output's path, writes calibration.json, and gives no
    plan (None) for a non-private training.

    Args:
        batches: a `madp.batch` output directory.
        output: the calibration.json to write (None: none is written).
        **options: the options of `madp train` by their snake_case names, the fields of
            `madp.training.options.TrainOptions`; the privacy ones: epsilon (target) or noise_multiplier
            (sigma fixed), delta, clip_norm, mechanism ("auto", "dpsgd", "bandmf", "none"), bands,
            strategy, amplified, max_contributions (default: read from the bound's report), mc_seed, ...

    Returns:
        The `madp.training.PrivacyPlan` (frozen; `to_json()` is calibration.json's content), with its
        `epsilon_curve`; None for mechanism "none" (calibration.json then says the training is not
        private).

    Raises:
        TypeError: an option that `madp train` does not have (the error lists those it has).
        madp.core.errors.InputError: bad options (neither or both of epsilon and noise_multiplier, a
            delta out of range, ...), batches whose report the accountant cannot read, or a target the
            mechanism cannot reach, or an output inside the batches; the message names the option or file.

    Example:
        >>> import madp, tempfile
        >>> from madp.tools.data.synthetic import GraphSpec, generate, write_dataset
        >>> work, spec = tempfile.mkdtemp(), GraphSpec(records=400, seed=1)
        >>> _ = write_dataset(generate(spec), spec, f"{work}/records.parquet", shards=1)
        >>> _ = madp.bound(f"{work}/records.parquet", f"{work}/bounded", max_contributions=3)
        >>> _ = madp.batch(f"{work}/bounded", f"{work}/records.parquet", f"{work}/batches", steps=12,
        ...                batch_size=8, min_sep=2, seed=0)  # seed: reproducible, NOT private
        >>> plan = madp.calibrate(f"{work}/batches", f"{work}/calibration.json", epsilon=8, delta=1e-5, bands=2)
        >>> plan.mechanism, plan.epsilon <= 8, plan.target_delta, plan.steps
        ('bandmf', True, 1e-05, 12)
        >>> len(plan.epsilon_curve)  # (sigma, epsilon) from sigma / 2 to 2 sigma
        9
    """
    calibrate_options = options_of("calibrate", TrainOptions, options)
    if output is not None:  # calibration.json inside the batch output would replace one of its files
        storage.refuse_overlap(output, [batches])
    return run_calibrate(batches, output, calibrate_options)


def run_calibrate(batches: str, output: str | None, options: TrainOptions) -> PrivacyPlan | None:
    """`calibrate` with its options built (`madp run` builds them from its calibrate stage's arguments)."""
    from madp.training.batches import open_batches
    from madp.training.plan import epsilon_curve, privacy_plan

    plan = privacy_plan(open_batches(batches), options)
    if plan is not None:
        plan = dataclasses.replace(plan, epsilon_curve=epsilon_curve(plan))
    if output is not None:
        storage.write_text(output, json.dumps(calibration_json(plan), indent=2))
    return plan


def calibration_json(plan: PrivacyPlan | None) -> dict[str, Any]:
    """What calibration.json holds of a plan (`calibrate`'s), or of no plan: a non-private training's."""
    from madp.training.plan import NOT_PRIVATE

    return {**NOT_PRIVATE, "epsilon_curve": []} if plan is None else plan.to_json()  # no plan: no curve either
