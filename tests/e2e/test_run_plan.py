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
COMMANDS = {"calibrate": "train", "baseline": "train", "internal-report": "report"}  # by stage, where not its name
# (config, its --set overrides): each config as it is, and overrides of what the plan renders otherwise
PLANNED = [(config, []) for config in CONFIGS] + [
    (DEMO, ["train.resume=true"]),
    (DEMO, ["train.retrain=true", "train.checkpoint_every=50"]),
    (DEMO, ["train.resume=false", "train.checkpoint_every=10", "calibrate.mc_workers=2", "calibrate.mc_runner=local"]),
    (DEMO, ["bound.runner=local", "bound.runner_options=[]", "batch.runner=local"]),
    (
        DEMO,
        [
            "bound.runner_options=[--partitions, 4, --rounds-per-pipeline, '3']",
            "batch.runner_options=[--partitions, 2]",
        ],
    ),
    (
        DEMO,
        ["bound.runner=FlinkRunner", "batch.runner=PrismRunner", "batch.runner_options=[--environment_type=LOOPBACK]"],
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
    (DEMO, ["batch.runner_options=[-k3]", "train.label=-x y", "train.features=-1"]),
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
    (DEMO, ["bound.runner_options=[--max-contrib, 2]"]),
    (DEMO, ["bound.runner_options=[--runner, local]"]),
    (DEMO, ["bound.runner_options=[-k3]"]),
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
    from madp.core.errors import InputError
    from madp.core.options import error_text
    from madp.jobs.audit import run_audit
    from madp.jobs.run_config import RunConfig
    from madp.jobs.run_plan import Source, stages_of

    planned = {}
    for config, overrides in PLANNED:
        stages = stages_of(
            RunConfig.read(config, overrides), Source(config, overrides, lambda *job: run_audit(*job, {}))
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
            stages_of(RunConfig.read(config, overrides), Source(config, overrides, lambda *job: run_audit(*job, {})))
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


@pytest.mark.parametrize(("config", "overrides"), PLANNED, ids=[" ".join([c, *o]) for c, o in PLANNED])
def test_each_stage_runs_what_its_command_says(config, overrides, monkeypatch):
    """A stage's step (its options built from the config, not from its command) is what `madp` would run
    for the stage's command: the command line's parser builds the same options from it."""
    from madp.cli import parser
    from madp.commands.data import GenerateOptions
    from madp.core.options import options_from
    from madp.core.records import ColumnOptions
    from madp.core.selection import BoundOptions
    from madp.engines.batching import BatchOptions
    from madp.jobs import run_steps
    from madp.jobs.audit import run_audit
    from madp.jobs.run_config import RunConfig
    from madp.jobs.run_plan import Source, stages_of
    from madp.training.options import TrainOptions

    monkeypatch.chdir(ROOT)
    for stage in stages_of(RunConfig.read(config, overrides), Source(config, overrides, run_audit)):
        args, runner_options = parser().parse_known_args(stage.command)
        step = stage.step
        if isinstance(step, run_steps.Generate):
            assert (step.output, step.options) == (args.output, options_from(GenerateOptions, args))
        elif isinstance(step, run_steps.Bound):
            built = options_from(BoundOptions, args)
            assert (step.input, step.output, step.options) == (args.input, args.output, built)
            assert (step.runner, list(step.runner_options)) == (args.runner, runner_options)
        elif isinstance(step, run_steps.Batch):
            built = options_from(BatchOptions, args)
            assert (step.selected, step.data, step.output) == (args.selected, args.data, args.output)
            assert (step.options, step.runner, list(step.runner_options)) == (built, args.runner, runner_options)
        elif isinstance(step, (run_steps.Calibrate, run_steps.Train)):
            built = options_from(TrainOptions, args)
            assert (step.batches, step.output, step.options) == (args.batches, args.output, built)
            assert isinstance(step, run_steps.Calibrate) == (stage.name == "calibrate")
        elif isinstance(step, run_steps.VerifyBound):
            assert (step.input, step.output, step.max_contributions) == (
                args.input,
                args.output,
                args.max_contributions,
            )
            assert (step.capacities, step.columns) == (args.capacities, options_from(ColumnOptions, args).columns)
        elif isinstance(step, run_steps.VerifyBatches):
            assert (step.output, step.data, step.selected) == (args.output, args.data, args.selected)
            assert (step.min_sep, step.max_batch_size) == (args.min_sep, args.max_batch_size)
            assert args.max_participations is None and args.capacities is None
            assert (step.max_contributions, step.columns) == (
                args.max_contributions,
                options_from(ColumnOptions, args).columns,
            )
        elif isinstance(step, run_steps.Audit):
            assert (step.config, list(step.overrides)) == (args.config, args.set)
        else:
            assert isinstance(step, run_steps.Report)
            assert (step.run_dir, step.output, step.internal) == (args.run_dir, args.output, args.internal)
        assert args.command == COMMANDS.get(stage.name, stage.name)
        assert runner_options == [] or isinstance(step, (run_steps.Bound, run_steps.Batch))


@pytest.mark.parametrize("case", [" ".join([config, *overrides]) for config, overrides in REFUSED])
def test_a_bad_config_is_refused_with_the_recorded_message(made, recorded, case):
    assert made["refused"][case] == recorded["refused"][case]


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    os.chdir(ROOT)
    with open(RECORDED, "w", encoding="utf-8") as handle:
        json.dump(plans(), handle, indent=1)
        handle.write("\n")
