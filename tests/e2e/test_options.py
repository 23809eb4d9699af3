"""Options declared once (`madp.core.options`): each options dataclass is its command's options, with
their defaults; `madp run` reads its section facts from them; errors name parameters to a Python caller
and flags on the command line; the options reference is generated from them."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from madp.accounting.mechanisms import DpSgd
from madp.cli import main, parser
from madp.core.errors import InputError, OptionError
from madp.core.options import declared, error_text, flag_of, options_from
from madp.core.records import ColumnOptions
from madp.core.selection import BoundOptions
from madp.engines.batching import BatchOptions
from madp.jobs.reference import (
    COMMAND_DECLARATIONS,
    DECLARATIONS,
    LAID_OUT_AS,
    OUTPUTS,
    ROOTS,
    field_comments,
    schemas,
)
from madp.jobs.run_plan import CALIBRATE_KEYS, HOW_ONLY
from madp.training.options import TrainOptions

NOT_OPTIONS = {BoundOptions: {"group_sizes"}}  # the engines' count of the two groups of --order alternate
REQUIRED = {  # each command's positional arguments and required options (train's: a privacy option)
    "bound": ["IN", "OUT", "-k", "2"],
    "batch": ["SEL", "DATA", "OUT", "--steps", "3", "--batch-size", "4"],
    "train": ["BATCHES", "OUT", "--epsilon", "1"],
}


@pytest.mark.parametrize("command, declaration", DECLARATIONS)
def test_each_field_is_one_option_of_its_command_and_each_option_a_field(command, declaration):
    options = parser().commands[command].options
    flags = {dest: action.option_strings for dest, action in options.items() if dest not in ("help", "runner")}
    fields = {field.name for field in dataclasses.fields(declaration)} - NOT_OPTIONS.get(declaration, set())
    assert set(flags) == fields
    for each in declared(declaration):
        assert flags[each.name][0] == flag_of(each.name)  # the field is named as its flag


@pytest.mark.parametrize("command, declaration", COMMAND_DECLARATIONS)
def test_the_options_of_a_command_madp_run_does_not_run_are_its_declarations(command, declaration):
    """Each option of `madp calibrate`, `madp recommend-k`, the verifiers and the report is a field of its
    declaration, with the field's default (a required one required)."""
    actions = {dest: action for dest, action in parser().commands[command].options.items() if dest != "help"}
    assert set(actions) == {each.name for each in declared(declaration)}
    for each in declared(declaration):
        action = actions[each.name]
        assert action.option_strings[0] == flag_of(each.name)
        assert action.required if each.required else action.default == each.default


@pytest.mark.parametrize("command, declaration", DECLARATIONS)
def test_defaults_come_from_the_fields(command, declaration):
    """The parser's default of each option is its field's, so the options left off a command line build
    the dataclass a Python caller gets by leaving them out."""
    madp = parser()
    actions = madp.commands[command].options
    for each in declared(declaration):
        action = actions[each.name]
        assert action.required if each.required else action.default == each.default or each.option.repeatable
    args, _ = madp.parse_known_args([command, *REQUIRED[command]])
    given = {each.name: getattr(args, each.name) for each in declared(declaration) if each.required}
    privacy = {"epsilon": 1.0} if declaration is TrainOptions else {}
    assert options_from(declaration, args) == declaration(**given, **privacy)


def test_run_reads_its_sections_and_how_only_options_from_the_declaration():
    """The calibrate keys and the options left out of a stage's fingerprint, as madp run listed them by hand:
    a fingerprint (`Stage.parameters`) of an existing run directory stays what it was."""
    assert set(CALIBRATE_KEYS) == {
        "epsilon",
        "delta",
        "noise_multiplier",
        "mechanism",
        "bands",
        "strategy",
        "clip_norm",
        "max_contributions",
        "amplified",
        "mc_samples",
        "mc_workers",
        "mc_runner",
        "mc_seed",
    }
    assert HOW_ONLY == {
        "train": {
            "--resume": 0,
            "--retrain": 0,
            "--checkpoint-every": 1,
            "--mc-workers": 1,
            "--batches-copy": 1,
            "--file-system-options": 1,
        }
    }


@pytest.mark.parametrize(
    "build, argv, python, cli",
    [
        (
            lambda: TrainOptions(epsilon=1.0, bands=0),
            ["train", "B", "O", "--epsilon", "1", "--bands", "0"],
            "bands must be at least 1",
            "--bands must be at least 1",
        ),
        (
            lambda: TrainOptions(noise_multiplier=1.0, calibration="plan.json"),
            ["train", "B", "O", "--noise-multiplier", "1", "--calibration", "plan.json"],
            "calibration fixes sigma: drop epsilon and noise_multiplier",
            "--calibration fixes sigma: drop --epsilon and --noise-multiplier",
        ),
        (
            lambda: BoundOptions(max_contributions=0),
            ["bound", "I", "O", "-k", "0", "--runner", "local"],
            "max_contributions must be at least 1",
            "--max-contributions must be at least 1",
        ),
        (
            lambda: BoundOptions(max_contributions=1, users_column="a", users_columns=("b", "c")),
            ["bound", "I", "O", "-k", "1", "--users-column", "a", "--users-columns", "b,c"],
            "users_column a and users_columns b,c: give one of them",
            "--users-column a and --users-columns b,c: give one of them",
        ),
        (
            lambda: BatchOptions(steps=3, batch_size=4, find_max_min_sep=True),
            ["batch", "S", "D", "O", "--steps", "3", "--batch-size", "4", "--find-max-min-sep"],
            "find_max_min_sep applies to sampler minsep-greedy",
            "--find-max-min-sep applies to --sampler minsep-greedy",
        ),
        (
            lambda: DpSgd(2.0, 10),
            [
                "epsilon",
                "--mechanism",
                "dpsgd",
                "--delta",
                "1e-5",
                "--steps",
                "10",
                "--sampling-prob",
                "2",
                "--noise-multiplier",
                "1",
            ],
            "sampling_prob must be in (0, 1], got 2.0",
            "--sampling-prob must be in (0, 1], got 2.0",
        ),
    ],
)
def test_a_python_caller_reads_parameters_and_the_command_line_flags(build, argv, python, cli, tmp_path, capsys):
    with pytest.raises(OptionError) as refused:
        build()
    assert str(refused.value).startswith(python)
    assert error_text(refused.value).startswith(cli)
    given = [str(tmp_path / arg) if arg.isupper() and len(arg) == 1 else arg for arg in argv]  # paths, none read
    assert main(given) == 2
    assert f"madp {argv[0]}: error: {cli}" in capsys.readouterr().err


def test_an_option_error_keeps_its_template_through_pickling():
    """A Beam worker's or a process pool's error reaches the driver pickled, and is still rendered by flag."""
    with pytest.raises(OptionError) as refused:
        TrainOptions(epsilon=1.0, ngrams=500)
    again = pickle.loads(pickle.dumps(refused.value))
    assert isinstance(again, InputError) and str(again) == str(refused.value)
    assert again.named(flag_of).startswith("--ngrams must be between 1 (words) and --max-length (128)")


def test_a_choice_is_checked_for_a_python_caller_too():
    with pytest.raises(OptionError, match="^strategy must be one of sqrt, optimized"):
        TrainOptions(epsilon=1.0, strategy="magic")
    with pytest.raises(OptionError, match="^user_ids must be one of email, as-is"):
        ColumnOptions(user_ids="lower")


def test_each_output_is_of_a_stage_the_reference_lists():
    stages = {each.stage for each in OUTPUTS} | {each.output_of for each in OUTPUTS if each.output_of}
    assert stages | set(LAID_OUT_AS) | set(LAID_OUT_AS.values()) == set(ROOTS)


def test_every_field_of_an_output_schema_says_what_it_means():
    listed = schemas()
    assert {each.schema for each in OUTPUTS if each.schema} < set(listed)  # the fields' own classes too
    unexplained = [
        f"{schema.__qualname__}.{field.name}"
        for schema in listed
        for field in dataclasses.fields(schema)
        if not field_comments(schema).get(field.name)
    ]
    assert not unexplained, f"give these fields a comment (docs/reference/outputs.md shows it): {unexplained}"


def test_a_field_comment_is_read_from_its_line_or_the_lines_above():
    @dataclasses.dataclass
    class Example:
        plain: int  # on its line
        # above it,
        # on two lines
        spanning: int
        bare: int = 0

    assert field_comments(Example) == {"plain": "on its line", "spanning": "above it, on two lines", "bare": ""}
