"""The privacy plan's JSON: what calibration.json, privacy.json and the trainings ledger hold is read by users
and independent verifiers, so `PrivacyPlan` must read and write it byte for byte as the files are. The
files under data/ were written by madp before the plan was a dataclass (a second training composed with
the first; a Monte Carlo calibration with its epsilon curve)."""

from __future__ import annotations

import json
import math
import os

import pytest
from conftest import DATA, write_records

from madp.accounting.calibrate import epsilon
from madp.accounting.mechanisms import DpSgd
from madp.core.selection import BoundOptions
from madp.engines.batch_local import run_local as batch_local
from madp.engines.batching import BatchOptions
from madp.engines.local_engine import run_local as bound_local
from madp.stages.calibrating import run_calibrate
from madp.training.batches import open_batches
from madp.training.ledger import TrainingEntry, composition
from madp.training.options import TrainOptions
from madp.training.plan import NOT_PRIVATE, PrivacyPlan, privacy_plan, stated_plan, to_json


@pytest.mark.parametrize("name", ["privacy_composed.json", "calibration_monte_carlo.json"])
def test_a_plan_reads_and_writes_the_files_madp_wrote_byte_for_byte(name):
    text = open(os.path.join(DATA, name)).read()
    plan = PrivacyPlan.from_json(json.loads(text))
    assert json.dumps(plan.to_json(), indent=2) == text
    assert PrivacyPlan.from_json(plan.to_json()) == plan


def test_a_non_private_training_has_no_plan_and_other_json_is_no_plan():
    assert stated_plan(NOT_PRIVATE) is None
    text = open(os.path.join(DATA, "privacy_composed.json")).read()
    for broken in ({**json.loads(text), "unknown": 1}, {"mechanism": "dpsgd"}, {**json.loads(text), "mechanism": "x"}):
        with pytest.raises(ValueError, match="not a privacy plan madp wrote"):
            PrivacyPlan.from_json(broken)


@pytest.mark.parametrize(
    ("batching", "training"),
    [
        (BatchOptions(steps=20, batch_size=10, seed=1), TrainOptions(epsilon=2.0)),
        (BatchOptions(steps=20, batch_size=10, min_sep=2, seed=1), TrainOptions(epsilon=2.0, bands=2)),
        (BatchOptions(steps=20, batch_size=10, sampler="minsep-greedy", min_sep=3), TrainOptions(epsilon=2.0, bands=2)),
    ],
)
@pytest.mark.slow
def test_a_new_plan_survives_its_json_and_composes_with_its_ledger_entry(tmp_path, batching, training):
    rows = [{"id": i, "users": [i % 100, 1000 + i // 2], "features": [0.1], "label": i % 2} for i in range(300)]
    data = write_records(str(tmp_path / "records.jsonl"), rows)
    bound_local(data, str(tmp_path / "bounded"), BoundOptions(max_contributions=2))
    batch_local(str(tmp_path / "bounded"), data, str(tmp_path / "batches"), batching)
    plan = privacy_plan(open_batches(str(tmp_path / "batches")), training)
    assert plan is not None
    stated = json.loads(json.dumps(plan.to_json()))
    assert stated == plan.to_json() and PrivacyPlan.from_json(stated) == plan
    entry = {"output": "first", "mechanism": plan.mechanism, "parameters": to_json(plan.parameters)}
    entry.update(noise_multiplier=plan.noise_multiplier, batch_files="these", truncation_probability=0.0)
    composed = composition(plan, [TrainingEntry.from_json(entry, "a ledger")], "these")
    assert composed is not None and composed.trainings == 2, "the same mechanism and parameters compose"
    assert composed.independent_batches is None
    independent = composition(
        plan, [TrainingEntry.from_json({**entry, "batch_files": "other batches"}, "a ledger")], "these"
    )
    assert independent is not None and independent.independent_batches == 1
    assert plan.epsilon < independent.epsilon <= composed.epsilon * (1 + 1e-6), "a shared sampling costs no less"


def test_batches_of_every_record_in_every_step_are_calibrated_with_their_curve(tmp_path):
    """Batches at --min-sep 1 whose batch size is every selected copy sample at p = 1: `madp run`'s calibrate
    stage accounts them without amplification, T Gaussian mechanisms of sensitivity k (DP-SGD at q = 1), its
    sigma-epsilon curve included, which passes sigma 0.5286 where dp_accounting's mixture of Gaussians raised a
    TypeError; with a target epsilon too, and the curve read back from calibration.json."""
    rows = [{"id": i, "users": [i % 16, 100 + i // 2], "features": [0.1], "label": i % 2} for i in range(64)]
    data = write_records(str(tmp_path / "records.jsonl"), rows)
    bound = bound_local(data, str(tmp_path / "bounded"), BoundOptions(max_contributions=4))
    every_copy = BatchOptions(steps=5, batch_size=bound.selected_records, seed=1)
    batch_local(str(tmp_path / "bounded"), data, str(tmp_path / "batches"), every_copy)
    sigma = 2 * 0.5285933102414113  # the curve starts at sigma / 2
    output = str(tmp_path / "calibration.json")
    plan = run_calibrate(str(tmp_path / "batches"), output, TrainOptions(noise_multiplier=sigma))
    assert plan is not None and plan.parameters == DpSgd(1.0, 5, 4) and plan.epsilon_curve is not None
    assert plan.epsilon_curve[0] == (sigma / 2, epsilon(DpSgd(1.0, 5, 4), sigma / 2, 1e-5, discretization=1e-2))
    assert len(plan.epsilon_curve) == 9 and all(math.isfinite(e) for _, e in plan.epsilon_curve)
    assert PrivacyPlan.from_json(json.loads(open(output).read())) == plan
    calibrated = run_calibrate(str(tmp_path / "batches"), None, TrainOptions(epsilon=20.0))
    assert calibrated is not None and calibrated.epsilon <= 20.0 and calibrated.epsilon_curve is not None
