"""The Python API of the steps (`madp.bound`, `madp.batch`, `madp.calibrate`, `madp.train`,
`madp.recommend_k`, from `madp.stages`): the same outputs, byte for byte, as the commands on the same
options; unknown options named; `import madp` cheap; and every exported name of `madp`,
`madp.accounting`, `madp.beam` and `madp.training` documented, its example run."""

from __future__ import annotations

import dataclasses
import doctest
import importlib
import json
import os
import pydoc
import re
import subprocess
import sys

import pytest

import madp
import madp.accounting
import madp.training
from madp.cli import main
from madp.core.errors import InputError, OptionError
from madp.core.selection import read_bound_report
from madp.jobs.run_config import RunConfig
from madp.jobs.run_plan import stages_of
from madp.tools.data.synthetic import GraphSpec, generate, write_dataset

SEED_OPTIONS = {"max_contributions": 3, "seed": 5, "order": "hash"}
BATCH_OPTIONS = {"steps": 12, "batch_size": 8.0, "min_sep": 2, "max_batch_size": 16, "seed": 0}


def files_of(directory) -> dict[str, bytes]:
    """Every file under `directory` but the reports (they hold paths and times), by relative path."""
    found = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            if name != "report.json" and not name.startswith(".madp"):
                found[os.path.relpath(path, directory)] = open(path, "rb").read()
    return found


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> str:
    spec = GraphSpec(records=400, seed=1)
    path = str(tmp_path_factory.mktemp("stages") / "records.parquet")
    write_dataset(generate(spec), spec, path, shards=1)
    return path


@pytest.fixture(scope="module")
def both(records, tmp_path_factory):
    """The Python API's and the CLI's bound, batches and calibration.json on the same options."""
    api, cli = tmp_path_factory.mktemp("api"), tmp_path_factory.mktemp("cli")
    bound = madp.bound(records, str(api / "bounded"), **SEED_OPTIONS)
    batched = madp.batch(str(api / "bounded"), records, str(api / "batches"), **BATCH_OPTIONS)
    # epsilon=8, an int, as a Python caller writes it: the plan states 8.0, as the command line's float
    plan = madp.calibrate(str(api / "batches"), str(api / "calibration.json"), epsilon=8, bands=2, clip_norm=0.5)
    flags = ["-k", "3", "--seed", "5", "--order", "hash", "--runner", "local"]
    assert main(["-q", "bound", records, str(cli / "bounded"), *flags]) == 0
    flags = ["--steps", "12", "--batch-size", "8", "--min-sep", "2", "--max-batch-size", "16", "--seed", "0"]
    assert main(["-q", "batch", str(cli / "bounded"), records, str(cli / "batches"), *flags, "--runner", "local"]) == 0
    # what `madp run`'s calibrate stage runs, on the run_dir's batches
    config = {"run_dir": str(cli), "input": records, "calibrate": {"epsilon": 8, "bands": 2, "clip_norm": 0.5}}
    (calibrate,) = stages_of(RunConfig.from_json(config))
    assert calibrate.command[-6:] == ["--epsilon", "8", "--bands", "2", "--clip-norm", "0.5"]
    stated = calibrate.step.run()
    return api, cli, bound, batched, plan, stated


def test_bound_batch_and_calibrate_write_what_the_commands_write(both, capsys):
    api, cli, bound, batched, plan, stated = both
    capsys.readouterr()
    for step in ("bounded", "batches"):
        written = files_of(api / step)
        assert written and written == files_of(cli / step), step
    assert (api / "calibration.json").read_bytes() == (cli / "calibration.json").read_bytes()
    assert plan.to_json() == stated == json.loads((api / "calibration.json").read_text())
    assert (plan.mechanism, plan.steps, plan.clip_norm, plan.min_sep) == ("bandmf", 12, 0.5, 2)
    assert len(plan.epsilon_curve) == 9 and plan.epsilon <= 8
    # the whole reports, as report.json holds them (the bound's with its wall time, which the file leaves out)
    assert bound.contribution_bound == 3 and bound.per_round and bound.wall_time_s is not None
    assert dataclasses.replace(bound, wall_time_s=None) == read_bound_report(str(api / "bounded"))
    assert batched.to_json() == json.loads((api / "batches" / "report.json").read_text())
    cli_report = json.loads((cli / "batches" / "report.json").read_text())
    assert batched.batch_sizes.to_json() == cli_report["batch_sizes"]
    assert [entry.to_json() for entry in batched.files] == cli_report["files"]


def test_calibrate_without_output_writes_nothing_and_a_non_private_training_has_no_plan(both, tmp_path):
    api = both[0]
    assert madp.calibrate(str(api / "batches"), noise_multiplier=2.0, bands=2).noise_multiplier == 2.0
    assert madp.calibrate(str(api / "batches"), str(tmp_path / "none.json"), mechanism="none") is None
    assert json.loads((tmp_path / "none.json").read_text()) == {
        "mechanism": "none",
        "private": False,
        "epsilon_curve": [],
    }


@pytest.mark.parametrize(
    "call, meant",
    [
        (lambda r, out: madp.bound(r, out, max_contribution=3), "max_contribution (did you mean max_contributions?)"),
        (lambda r, out: madp.batch(r, r, out, steps=3, batch_size=2, minsep=2), "minsep (did you mean min_sep?)"),
        (lambda r, out: madp.calibrate(out, epsilom=8), "epsilom (did you mean epsilon?)"),
        (lambda r, out: madp.train(r, out, no_such_option=1), "no_such_option;"),
        (lambda r, out: madp.recommend_k(r, epsilon=1, delta=1e-5, steps=2, batch_size=1, k=(1,)), "k (did"),
        (
            lambda r, out: madp.bound(r, out, max_contributions=2, beam_options=["--partitions", "2"]),
            "beam_options (did you mean runner_options?)",
        ),
        (
            lambda r, out: madp.batch(r, r, out, steps=3, batch_size=2, beam_options=["--partitions", "2"]),
            "beam_options (did you mean runner_options?)",
        ),
    ],
    ids=["bound", "batch", "calibrate", "train", "recommend_k", "bound-beam_options", "batch-beam_options"],
)
def test_an_unknown_option_is_named_with_the_options_the_step_has(records, tmp_path, call, meant):
    with pytest.raises(TypeError, match=r"\(\) got unknown options: ") as raised:
        call(records, str(tmp_path / "out"))
    said = str(raised.value)
    assert meant in said and "; its options are " in said
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_the_output_is_held_and_kept_apart_from_the_inputs_as_the_command_line_does(records, tmp_path):
    with pytest.raises(InputError, match="overlaps input"):
        madp.bound(records, os.path.dirname(records), max_contributions=2)
    with pytest.raises(InputError, match="--runner local takes no runner options"):
        madp.bound(records, str(tmp_path / "out"), max_contributions=2, runner_options=["--partitions", "2"])
    assert not (tmp_path / "out" / ".madp.lock").exists()  # released after the refusal


@pytest.mark.parametrize(
    "options, said",
    [
        ({"max_contributions": 2.5}, "max_contributions must be an integer, got 2.5"),
        ({"max_contributions": True}, "max_contributions must be an integer, got True"),
        ({"max_contributions": 2, "seed": None}, "seed must be an integer, got None"),
        ({"max_contributions": 2, "users_columns": "users"}, "users_columns must be a list, got 'users'"),
    ],
)
def test_a_value_the_command_line_would_refuse_is_refused_by_name(records, tmp_path, options, said):
    """A float, a bool or None for an integer option, a string for a list one: refused before anything is
    written, as the command line refuses it (a float row limit crashed the batching after it had cleared
    the earlier batches)."""
    with pytest.raises(InputError, match=said):
        madp.bound(records, str(tmp_path / "out"), **options)
    with pytest.raises(InputError, match="max_batch_size must be an integer, got 4.5"):
        madp.batch(records, records, str(tmp_path / "out"), steps=3, batch_size=2, max_batch_size=4.5)
    assert not (tmp_path / "out").exists()


def test_calibration_json_is_never_written_into_the_batches(both):
    api = both[0]
    with pytest.raises(InputError, match="overlaps input"):
        madp.calibrate(str(api / "batches"), str(api / "batches" / "report.json"), epsilon=8, bands=2)
    assert json.loads((api / "batches" / "report.json").read_text())["files"]  # the batch report, intact


def test_a_plan_refused_names_the_parameters_as_a_python_caller_passes_them(both):
    """The command line says `--max-contributions 1 is below ...` (test_training's refusals)."""
    api = both[0]
    with pytest.raises(OptionError, match="^max_contributions 1 is below what the batches were made from"):
        madp.calibrate(str(api / "batches"), noise_multiplier=2.0, bands=2, max_contributions=1)


@pytest.mark.tf
def test_train_refuses_a_calibration_for_another_clip_norm_by_the_parameters_names(both, tmp_path):
    calibration = str(both[0] / "calibration.json")
    said = rf"^calibration {re.escape(calibration)} is for clip norm 0.5, not clip_norm 1.0$"
    with pytest.raises(OptionError, match=said):
        madp.train(str(both[0] / "batches"), str(tmp_path / "model"), calibration=calibration, clip_norm=1.0)


@pytest.mark.tf
@pytest.mark.slow
def test_train_trains_the_model_madp_train_trains(both, capsys):
    """The same batches (the API's and the command's, equal), calibration, model seed and noise seed: the same
    weights bit for bit, and the same privacy.json but for the paths it names."""
    import numpy as np
    import tf_keras

    api, cli = both[0], both[1]
    options = {"noise_seed": 3, "learning_rate": 0.5, "clip_norm": 0.5, "eval_every": 12}
    madp.train(str(api / "batches"), str(api / "model"), calibration=str(api / "calibration.json"), **options)
    flags = ["--noise-seed", "3", "--learning-rate", "0.5", "--clip-norm", "0.5", "--eval-every", "12"]
    command = ["-q", "train", str(cli / "batches"), str(cli / "model"), "--calibration", str(cli / "calibration.json")]
    assert main([*command, *flags]) == 0
    capsys.readouterr()
    weights = [
        tf_keras.models.load_model(str(d / "model" / "model.keras"), compile=False).get_weights() for d in (api, cli)
    ]
    for a, b in zip(*weights):
        np.testing.assert_array_equal(a, b)
    stated = [json.loads((d / "model" / "privacy.json").read_text()) for d in (api, cli)]
    for plan, directory in zip(stated, (api, cli)):
        assert plan.pop("trained_on") == str(directory / "batches")
        assert plan.pop("calibration") == str(directory / "calibration.json")
    assert stated[0] == stated[1] and stated[0]["noise"] == "fixed seed - not private"


@pytest.mark.beam
def test_a_beam_runner_bounds_as_the_local_engine(records, both, tmp_path):
    madp.bound(
        records, str(tmp_path / "beam"), runner="DirectRunner", runner_options=["--partitions", "2"], **SEED_OPTIONS
    )
    assert files_of(tmp_path / "beam") == files_of(both[0] / "bounded")


@pytest.mark.slow
def test_import_madp_imports_no_engine_and_its_steps_none_until_they_run():
    cheap = "import sys, madp; assert not {'apache_beam', 'tensorflow', 'madp.stages'} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", cheap], check=True)
    steps = (
        "import sys; from madp import batch, bound, calibrate, recommend_k, train; import madp.accounting; "
        "assert not {'apache_beam', 'tensorflow'} & set(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", steps], check=True)
    assert set(madp.__all__) <= set(dir(madp))
    with pytest.raises(AttributeError):
        madp.no_such_step  # noqa: B018
    shown = pydoc.render_doc(madp.bound)
    assert "Args:" in shown and "max_contributions" in shown and ">>> report = madp.bound(" in shown


def exported() -> list[tuple[str, str]]:
    import madp.beam

    packages = (madp, madp.accounting, madp.beam, madp.training)
    return [(package.__name__, name) for package in packages for name in package.__all__]


def imports_tensorflow(package: str) -> bool:
    """Whether reading a name of `package` imports TensorFlow: `madp.training` forwards its names to
    `madp.training.api`, which imports it."""
    return package == "madp.training"


@pytest.mark.parametrize(
    "package, name",
    [pytest.param(p, n, id=f"{p}.{n}", marks=[pytest.mark.tf] if imports_tensorflow(p) else []) for p, n in exported()],
)
def test_every_exported_name_has_args_returns_raises_and_an_example(package, name):
    if imports_tensorflow(package):
        pytest.importorskip("tensorflow")
    doc = getattr(importlib.import_module(package), name).__doc__ or ""
    missing = [section for section in ("Args:", "Returns:", "Raises:", "Example") if f"\n    {section}" not in doc]
    assert not missing, f"{package}.{name}'s docstring lacks {missing}"


# Trainings (TensorFlow); numba compiling
SLOW_EXAMPLES = {"train", "make_private", "calibrate_minsep", "epsilon_minsep", "MinSepRelease"}
# Made by a function whose example runs (open_batches, make_private, make_non_private): their own examples
# show what to do with one, as madp.beam's show a transform in a pipeline, and are not run
SHOWN_NOT_RUN = {"Batches", "PrivateTrainingStep", "NonPrivateStep"}


def needs_tensorflow(package: str, name: str) -> bool:
    """Whether an example trains (`madp.train`) or its name imports TensorFlow (`imports_tensorflow`)."""
    return imports_tensorflow(package) or (package, name) == ("madp", "train")


def examples() -> list:
    names = [(package.__name__, name) for package in (madp, madp.accounting, madp.training) for name in package.__all__]
    return [
        pytest.param(
            package,
            name,
            marks=[
                *([pytest.mark.slow] if name in SLOW_EXAMPLES else []),
                *([pytest.mark.tf] if needs_tensorflow(package, name) else []),
            ],
        )
        for package, name in names
        if name not in SHOWN_NOT_RUN
    ]


@pytest.mark.slow
@pytest.mark.parametrize("package, name", examples(), ids=lambda value: value)
def test_the_examples_run_as_written(package, name):
    if needs_tensorflow(package, name):
        pytest.importorskip("tensorflow")
    value = getattr(importlib.import_module(package), name)
    finder, runner = doctest.DocTestFinder(recurse=False), doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    (test,) = finder.find(value, f"{package}.{name}", globs={})
    assert test.examples, f"{package}.{name} has no example to run"
    runner.run(test)
    assert runner.summarize(verbose=False).failed == 0
