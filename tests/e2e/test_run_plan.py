"""`madp run`'s plans, against those recorded in tests/data/run_plans.json: for the configs of examples/ and
runners/ (and some overrides of them), each stage's name, command, parameters, inputs and output, and for bad
configs the message. `Stage.parameters` is what `madp run` fingerprints: a change to it re-runs the stages of
every existing run directory (a training among them), so a plan may change only on purpose; then
`python tests/e2e/test_run_plan.py` records the plans again."""

from __future__ import annotations

import json
import os
import sys

import pytest

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)
RECORDED = os.path.join(TESTS, "data", "run_plans.json")
CONFIGS = sorted(
    f"{folder}/{name}"
    for folder in ("examples", "runners")
    for name in os.listdir(os.path.join(ROOT, folder))
    if name.endswith(".yaml")
)
DEMO = "examples/demo.yaml"
# (config, its --set overrides): each config as it is, and overrides of what the plan renders otherwise
PLANNED = [(config, []) for config in CONFIGS] + [
    (DEMO, ["train.resume=true"]),
    (DEMO, ["train.retrain=true", "train.checkpoint_every=50"]),
    (DEMO, ["train.resume=false", "train.checkpoint_every=10", "calibrate.mc_workers=2", "calibrate.mc_runner=local"]),
    (DEMO, ["bound.runner=local", "bound.beam_options=[]", "batch.runner=local"]),
    (
        DEMO,
        ["bound.beam_options=[--partitions, 4, --rounds-per-pipeline, '3']", "batch.beam_options=[--partitions, 2]"],
    ),
    (
        DEMO,
        ["bound.runner=FlinkRunner", "batch.runner=PrismRunner", "batch.beam_options=[--environment_type=LOOPBACK]"],
    ),
    (DEMO, ["bound.users_columns=[from, to, cc]", "batch.content_columns=[features, label]", "batch.seed=7"]),
    (
        DEMO,
        ["bound.order=hash", "bound.seed=3", "bound.id_column=key", "bound.user_ids=email", "bound.on_invalid=skip"],
    ),
    (
        DEMO,
        ["batch.sampler=minsep-greedy", "batch.find_max_min_sep=true", "batch.warm_up=0", "batch.max_batch_size=null"],
    ),
    (
        DEMO,
        ["calibrate.noise_multiplier=1.5", "calibrate.epsilon=null", "calibrate.amplified=true", "calibrate.mc_seed=4"],
    ),
    (
        DEMO,
        ["calibrate.mechanism=none", "calibrate.clip_norm=0.5", "calibrate.delta=1e-6", "calibrate.strategy=optimized"],
    ),
    (DEMO, ["train.eval_data_public=false", "train.baseline=false", "train.learning_rate=0.1", "train.seed=9"]),
    (DEMO, ["train.model=mlp", "train.inputs=[a, b]", "train.model_path=[x, y]", "train.eval_data=held.parquet"]),
    (
        DEMO,
        [
            "generate.holdout=false",
            "train.eval_data_public=false",
            "generate.users_as=both",
            "generate.task=text",
            "generate.mean_arity=3",
        ],
    ),
    (DEMO, ["train=null", "report=false"]),
    (DEMO, ["calibrate=null", "train=null", "batch=null"]),
    ("examples/text-classifier.yaml", ["train.labels=[a, b, c]", "train.width=32", "train.xla=false"]),
    (DEMO, ["batch.beam_options=[-k3]", "train.label=-x y", "train.features=-1"]),
    ("runners/direct.yaml", ["bound.capacities=tests/data/capacities.csv", "batch.min_sep=1", "calibrate.bands=1"]),
    ("runners/direct.yaml", ["bound.users_column=people", "batch.users_column=people", "train.resume=true"]),
]
# (config, overrides) that the plan refuses, with its message
REFUSED = [
    (DEMO, ["batch.steps=null"]),
    (DEMO, ["batch.steps=many"]),
    (DEMO, ["batch.sampler=fancy"]),
    (DEMO, ["batch.seed=-1"]),
    (DEMO, ["batch.find_max_min_sep=yes"]),
    (DEMO, ["batch.steps=null", "batch.batch_size=null"]),
    (DEMO, ["bound.order_by=arity"]),
    (DEMO, ["bound.partitions=8"]),
    (DEMO, ["bound.max_contributions=0"]),
    (DEMO, ["bound.max_contributions=null"]),
    (DEMO, ["bound.beam_options=[--max-contrib, 2]"]),
    (DEMO, ["bound.beam_options=[--runner, local]"]),
    (DEMO, ["bound.beam_options=[-k3]"]),
    (DEMO, ["bound.runner=local"]),
    (DEMO, ["bound.users_column=a", "bound.users_columns=[b, c]"]),
    (DEMO, ["batch.id_column=other"]),
    (DEMO, ["batch.users_columns=[a, b]"]),
    (DEMO, ["calibrate.epsilon=null"]),
    (DEMO, ["calibrate.mechanism=fancy"]),
    (DEMO, ["calibrate.model=mlp"]),
    (DEMO, ["calibrate.amplified=1"]),
    (DEMO, ["train.epsilon=2"]),
    (DEMO, ["train.unknown=2"]),
    (DEMO, ["train.seed=2.5"]),
    (DEMO, ["train.learning_rate=-1e-5"]),
    (DEMO, ["train.learning_rate=-0.5"]),
    (DEMO, ["train.distribution=fancy"]),
    (DEMO, ["train.eval_data=demo-output/train/x.parquet"]),
    (DEMO, ["train.label=-x"]),
    (DEMO, ["generate.records=null"]),
    (DEMO, ["generate.graph=ring"]),
    (DEMO, ["generate.seed=-2"]),
    (DEMO, ["generate.nodes=3"]),
    (DEMO, ["generate.holdout=maybe"]),
    (DEMO, ["generate=null", "input=demo-output/bound"]),
    (DEMO, ["generate=null"]),
    ("examples/audit.yaml", ["audit.canaries=many"]),
    (DEMO, ["report=1"]),
    (DEMO, ["bound.capacities=tests/data/none.csv"]),
    (DEMO, ["calibrate=null"]),
]


def plans() -> dict:
    """The plan of each of `PLANNED`, and the message of each of `REFUSED`, as this checkout makes them."""
    from madp.commands.registry import error_text
    from madp.core.errors import InputError
    from madp.jobs.audit import run_audit
    from madp.jobs.run_plan import Source, load_config, plan_stages

    planned = {}
    for config, overrides in PLANNED:
        stages = plan_stages(
            load_config(config, overrides), Source(config, overrides, lambda *job: run_audit(*job, {}))
        )
        planned[" ".join([config, *overrides])] = [
            {
                "name": stage.name,
                "command": stage.command,
                "parameters": stage.parameters,
                "inputs": list(stage.inputs),
                "output": stage.output,
            }
            for stage in stages
        ]
    refused = {}
    for config, overrides in REFUSED:
        with pytest.raises(InputError) as error:
            plan_stages(load_config(config, overrides), Source(config, overrides, lambda *job: run_audit(*job, {})))
        refused[" ".join([config, *overrides])] = error_text(error.value)
    return {"planned": planned, "refused": refused}


@pytest.fixture(scope="module")
def made():
    """This checkout's plans, made in the repository's root (the configs' paths are relative to it)."""
    here = os.getcwd()
    os.chdir(ROOT)
    try:
        return plans()
    finally:
        os.chdir(here)


@pytest.fixture(scope="module")
def recorded():
    with open(RECORDED, encoding="utf-8") as handle:
        return json.load(handle)


def test_every_example_and_runner_config_is_recorded(recorded):
    assert {key.split()[0] for key in recorded["planned"]} == set(CONFIGS)


@pytest.mark.parametrize("case", [" ".join([config, *overrides]) for config, overrides in PLANNED])
def test_a_config_plans_the_recorded_stages(made, recorded, case):
    assert made["planned"][case] == recorded["planned"][case]


@pytest.mark.parametrize("case", [" ".join([config, *overrides]) for config, overrides in REFUSED])
def test_a_bad_config_is_refused_with_the_recorded_message(made, recorded, case):
    assert made["refused"][case] == recorded["refused"][case]


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    os.chdir(ROOT)
    with open(RECORDED, "w", encoding="utf-8") as handle:
        json.dump(plans(), handle, indent=1)
        handle.write("\n")
