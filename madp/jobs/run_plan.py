"""`madp run CONFIG.yaml`, planning: a config becomes the stages it runs, generate -> bound -> batch
-> calibrate -> train (and audit), each optional (its section present or not).

A section's keys are the options of the `madp` command the stage runs, as their declarations say
(`madp.core.options`: `max_contributions: 3` is `--max-contributions 3`), so the config and the CLI
never drift apart; `runner` and `runner_options` say where a bound or batch stage runs. Each stage carries its step
(`madp.jobs.run_steps`: the function it runs, with its options built) and its rendering as a `madp`
command line (the log, the manifests, the fingerprint). The whole config is read and every stage's
options are built before anything runs.

Run directory layout: records/ and test.parquet (generate), bound/, batches/ (with the
independent verifiers run after each), calibration.json (the privacy plan the trainer uses),
train/, baseline/ (non-private, if asked), report.html (publishable) and internal-report.html (with
the baseline, the audit or evaluations on data not declared public; never published), and .madp/
with one manifest per finished stage (set aside as STAGE.pending.json while the stage runs again).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, NamedTuple, TypeVar

from madp.commands.data import GenerateOptions
from madp.core import storage
from madp.core.errors import InputError
from madp.core.options import CALIBRATE, Declared, declared, error_text, how_only_flags, section_keys
from madp.core.records import Columns, users_columns_of
from madp.core.selection import BoundOptions, largest_capacity
from madp.engines.batching import BatchOptions
from madp.jobs.run_config import RunConfig, audited
from madp.jobs.run_steps import (
    Audit,
    AuditJob,
    Batch,
    Bound,
    Calibrate,
    Generate,
    Report,
    Step,
    Train,
    VerifyBatches,
    VerifyBound,
)
from madp.tools.planning.audit_config import audit_directory
from madp.training.options import TrainOptions

# Keys of the calibrate section: the privacy options of `madp train`; the rest of them are the train section's.
CALIBRATE_KEYS = section_keys(TrainOptions, CALIBRATE)
INTERNAL_REPORT = "internal-report.html"  # the page with the baseline and the realized sampling: never published
# Options of a madp command that say only how a stage reaches its outputs, never what they are, by flag with the
# number of values each takes (`option(how_only=True)`): left out of the stage's parameters (`Stage.parameters`,
# what `madp run` fingerprints), so that a re-run that sets them otherwise finds the outputs up to date instead
# of training once more.
HOW_ONLY = {"train": how_only_flags(TrainOptions)}


# A command's own options besides its declared ones (what a runner option may not be, nor a section key name)
RUNNER_STAGE_OPTIONS = {"runner": ("--runner",)}
HELP_FLAGS = ("-h", "--help")  # argparse's, of every command
Declaration = TypeVar("Declaration")  # a dataclass of options (`madp.core.options.option`)
# Where argparse takes a value for a number, not an option (`argparse.ArgumentParser._negative_number_matcher`)
NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


@dataclasses.dataclass(frozen=True)
class Stage:
    """A stage of the run: its step, and that step as a `madp` command line."""

    name: str
    command: list[str]  # the `madp` command line of its step: the log line, the manifests, the fingerprint
    inputs: tuple[str, ...]  # paths whose files it reads
    output: str  # the path it writes (a directory, or calibration.json)
    step: Step  # what it runs, its options built

    @property
    def parameters(self) -> list[str]:
        """Its command without the options that say only how it reaches its outputs (`HOW_ONLY`)."""
        how = HOW_ONLY.get(self.command[0], {})
        kept: list[str] = []
        values_left = 0
        for token in self.command:
            if values_left:
                values_left -= 1
            elif token in how:
                values_left = how[token]
            else:
                kept.append(token)
        return kept


StepKind = TypeVar("StepKind")


def step_of(stages: Sequence[Stage], kind: type[StepKind]) -> StepKind | None:
    """The step of the first of the stages that runs a `kind` step (the bound stage's `Bound`), if any."""
    return next((stage.step for stage in stages if isinstance(stage.step, kind)), None)


class Source(NamedTuple):
    """What an audit stage re-reads, the config file and its `--set` overrides, and the audit job it runs."""

    config: str
    overrides: list[str]
    audit: AuditJob


def stages_of(config: RunConfig, source: Source | None = None) -> list[Stage]:
    """Validate the config and return the stages it asks for, in order, each with its options built.
    Without `source` an audit section is only validated."""
    run_dir = config.run_dir
    plan = _Plan(run_dir)
    data, eval_data = _data_stages(config, plan)
    bound = _bound_stages(config, plan, data)
    _batch_stages(config, plan, data, bound)
    _training_stages(config, plan, eval_data)
    if config.input is not None:  # a stage would replace, or read back, the user's records
        for stage in plan.stages:
            try:
                storage.refuse_overlap(stage.output, [config.input])
            except InputError as error:
                raise InputError(f"config input: stage {stage.name}: {error}") from None
    if config.audit is not None:
        directory = audit_directory(run_dir, audited(config, {}))
        if source is not None:
            command = ["audit", source.config, *(flag for o in source.overrides for flag in ("--set", o))]
            step = Audit(source.config, tuple(source.overrides), source.audit)
            plan.add("audit", command, (source.config, data), directory, lambda: step)
    if config.report:
        outputs = tuple(stage.output for stage in plan.stages)
        plan.add("report", ["report", run_dir], outputs, plan.path("report.html"), lambda: Report(run_dir))
        if any(_leaves_out(stage) for stage in plan.stages):  # what the published page leaves out
            internal = plan.path(INTERNAL_REPORT)
            command = ["report", run_dir, "--internal", "--output", internal]
            plan.add("internal-report", command, outputs, internal, lambda: Report(run_dir, internal, True))
    return [_checked(stage) for stage in plan.stages]  # every stage's options build before anything runs


@dataclasses.dataclass(frozen=True)
class _Planned:
    """A stage planned, its options read from the config but not built yet (`make` builds them, `_checked`
    calls it once the whole config is read)."""

    name: str
    command: list[str]
    inputs: tuple[str, ...]
    output: str
    make: Callable[[], Step]
    runner_options: Sequence[str] = ()  # a bound or batch stage's, which may not be
    own_flags: Sequence[str] = ()  # the options of its command (a bound or batch stage's)


@dataclasses.dataclass
class _Plan:
    """The stages planned so far, and where a run's outputs go."""

    run_dir: str
    stages: list[_Planned] = dataclasses.field(default_factory=list)

    def path(self, name: str) -> str:
        return storage.join(self.run_dir, name)

    def add(
        self,
        name: str,
        command: list[str],
        inputs: tuple[str, ...],
        output: str,
        make: Callable[[], Step],
        runner: tuple[Sequence[str], type] | None = None,
    ) -> None:
        """Plan a stage; `runner`: its runner options and the declaration of its command's own options."""
        runner_options, own = ((), ()) if runner is None else (runner[0], _own_flags(runner[1]))
        self.stages.append(_Planned(name, command, inputs, output, make, runner_options, own))


def _data_stages(config: RunConfig, plan: _Plan) -> tuple[str, str | None]:
    """(the records, the held-out records or None): the config's input, or a generate stage."""
    generate = config.generate
    if generate is None:
        assert config.input is not None  # `RunConfig.from_json` requires one of them
        return config.input, None
    records = plan.path("records")
    eval_data = plan.path("test.parquet") if generate.holdout else None
    given = _Options(GenerateOptions, _read("generate", GenerateOptions, generate.options))
    if eval_data is not None:
        given = given.then(_read("generate", GenerateOptions, [("holdout", eval_data)]))
    plan.add("generate", ["generate", records, *given.flags], (), records, lambda: Generate(records, given.built))
    return records, eval_data


def _bound_stages(config: RunConfig, plan: _Plan, data: str) -> _Options[BoundOptions] | None:
    """bound, then verify-bound; the bound's options as the section gives them (None: no bound section)."""
    bound = config.bound
    if bound is None:
        return None
    output = plan.path("bound")
    runner, runner_options = bound.runner, bound.runner_options
    given = _Options(BoundOptions, _read("bound", BoundOptions, bound.options, takes_runner_options=True))
    capacities = given.flags_of("capacities") if given.value("capacities") else []
    read = (data, capacities[1]) if capacities else (data,)  # an edited capacities file re-runs
    command = ["bound", data, output, *given.flags, "--runner", runner, *runner_options]
    plan.add(
        "bound",
        command,
        read,
        output,
        lambda: Bound(data, output, given.built, runner, runner_options),
        (runner_options, BoundOptions),
    )
    if "max_contributions" not in bound.names:
        raise InputError("config bound.max_contributions: required (the contribution bound K)")
    k = given.flags_of("max_contributions")
    columns = [token for entry in given.entries if entry.option.name in COLUMN_KEYS for token in entry.flags]

    def verify() -> VerifyBound:
        options = given.built
        return VerifyBound(data, output, options.max_contributions, options.capacities or None, options.columns)

    plan.add("verify-bound", ["verify-bound", data, output, *k, *capacities, *columns], (data, output), output, verify)
    return given


def _batch_stages(config: RunConfig, plan: _Plan, data: str, bound: _Options[BoundOptions] | None) -> None:
    """batch, then verify-batches against the bound's selection and contribution bound; both read the
    records with the bound's id and users columns and its user_ids (a batch section may only repeat them)."""
    batch = config.batch
    if batch is None:
        return
    if bound is None:
        raise InputError(
            "config batch: needs a bound section (the batches are made from its selection, and verify-batches "
            "checks them against its contribution bound)"
        )
    given_keys = dict(batch.options)
    columns = []
    for key, used in _bound_columns(bound).items():
        if key in given_keys and _column_value(key, given_keys.pop(key)) != used:
            raise InputError(
                f"config batch.{key}: differs from the bound's ({used!r}): batch and verify-batches read the "
                f"records with the columns the bound read; leave batch.{key} out"
            )
        columns.append((key, used))
    if "user_ids" in given_keys:  # left: the bound section has none
        raise InputError(
            "config batch.user_ids: the bound section says how user ids are read (bound.user_ids): batch and "
            "verify-batches read them as the bound did; leave batch.user_ids out"
        )
    other = sorted({"users_column", "users_columns"} & set(given_keys))  # left: the users option the bound did not use
    if other:
        bound_key = next(key for key in _bound_columns(bound) if key != "id_column")
        raise InputError(
            f"config batch.{other[0]}: the bound reads the users with {bound_key}: batch and verify-batches read "
            f"the records with the columns the bound read; leave batch.{other[0]} out"
        )
    path = plan.path
    selected, output = path("bound"), path("batches")
    runner, runner_options = batch.runner, batch.runner_options
    given = _Options(BatchOptions, _read("batch", BatchOptions, given_keys.items(), takes_runner_options=True))
    read_columns = _read("batch", BatchOptions, columns)
    given = given.then(read_columns)
    command = ["batch", selected, data, output, *given.flags, "--runner", runner, *runner_options]
    make = lambda: Batch(selected, data, output, given.built, runner, runner_options)  # noqa: E731
    plan.add("batch", command, (selected, data), output, make, (runner_options, BatchOptions))
    checks = given.flags_of("min_sep") or ["--min-sep", str(given.default("min_sep"))]
    if given.value("max_batch_size"):
        checks += given.flags_of("max_batch_size")
    k = _contribution_bound(bound)
    checks += ["--selected", selected, "--max-contributions", str(k)]
    column_flags = [token for entry in read_columns for token in entry.flags]

    def verify() -> VerifyBatches:
        options = given.built
        return VerifyBatches(output, data, options.min_sep, options.max_batch_size, selected, k, options.columns)

    command = ["verify-batches", output, data, *checks, *column_flags]
    plan.add("verify-batches", command, (output, data, selected), output, verify)


COLUMN_KEYS = ("id_column", "users_column", "users_columns", "user_ids")  # how the records are read


def _bound_columns(bound: _Options[BoundOptions]) -> dict[str, str]:
    """The bound section's id column and its users option (users_column, or users_columns as
    `a,b,c`), with their defaults (the columns `Columns` names where the options name none), and its
    user_ids when given: how batch and verify-batches must read the records."""
    users = "users_columns" if bound.value("users_columns") is not None else "users_column"
    read = Columns()  # the columns read where the options name none
    default = {"id_column": read.id, "users_column": read.users}
    given = {key: default[key] if bound.value(key) is None else bound.value(key) for key in ("id_column", users)}
    if bound.value("user_ids") is not None:
        given["user_ids"] = bound.value("user_ids")
    return {key: _column_value(key, value) for key, value in given.items()}


def _column_value(key: str, value: object) -> str:
    """A column option's value as its flag takes it (users_columns: a list or `a,b,c`, as `a,b,c`)."""
    if key == "users_columns":
        return ",".join(users_columns_of(value if isinstance(value, (str, list, tuple)) else str(value)))
    return str(value)


def _contribution_bound(bound: _Options[BoundOptions]) -> int:
    """What training accounts with: the bound section's K, or its largest capacity if larger (as
    `madp bound` reports it in `contribution_bound`)."""
    k = bound.value("max_contributions")
    if k is None:
        raise InputError("config bound.max_contributions: required, an integer (the contribution bound K)")
    capacities = bound.value("capacities")
    try:
        return largest_capacity(k, capacities or None)
    except InputError as error:
        raise InputError(f"config bound.capacities: {error}") from error


def _training_stages(config: RunConfig, plan: _Plan, eval_data: str | None) -> None:
    """calibrate (the privacy plan), train with it, and the non-private baseline if asked."""
    path = plan.path
    batches, calibration = path("batches"), path("calibration.json")
    calibrate, train = config.calibrate, config.train
    privacy: _Options[TrainOptions] | None = None
    if calibrate is not None:
        outside = sorted(calibrate.names - set(CALIBRATE_KEYS))
        if outside:
            raise InputError(
                f"config calibrate: {', '.join(outside)} belong to the train section "
                f"(calibrate takes {', '.join(CALIBRATE_KEYS)})"
            )
        stated = privacy = _Options(TrainOptions, _read("calibrate", TrainOptions, calibrate.options))
        command = ["train", batches, calibration, *privacy.flags]
        plan.add("calibrate", command, (batches,), calibration, lambda: Calibrate(batches, calibration, stated.built))
    if train is None:
        return
    inside = sorted(train.names & set(CALIBRATE_KEYS))
    if inside:
        raise InputError(f"config train: {', '.join(inside)} belong to the calibrate section")
    if privacy is None:
        raise InputError("config train: needs a calibrate section (the privacy plan it trains with)")
    if eval_data and "eval_data" not in train.names:
        train = train.with_options((("eval_data", eval_data),))
    section = _read("train", TrainOptions, train.options)
    clip = [entry for entry in privacy.entries if entry.option.name == "clip_norm"]  # the calibrated plan's clipping
    # files the trainings read besides the batches: a pretrained model replaced at the same path re-runs them
    given = _Options(TrainOptions, section)
    read = tuple(text for name in ("eval_data", "pretrained") if given.value(name) for text in given.flags_of(name)[1:])
    # A changed option re-runs a training into the same folder: it replaces the earlier one's outputs
    # itself, once its checks (plan, ledger) pass, and never under resume (`madp train --replace`).
    replace = _read("train", TrainOptions, [("replace", True)])
    planned = _read("train", TrainOptions, [("calibration", calibration)])
    trained = _Options(TrainOptions, (*planned, *clip, *section, *replace))
    model = path("train")
    make = lambda: Train(batches, model, trained.built)  # noqa: E731
    plan.add("train", ["train", batches, model, *trained.flags], (batches, calibration, *read), model, make)
    if train.baseline:
        unplanned = _read("train", TrainOptions, [("mechanism", "none")])
        untrained = _Options(TrainOptions, (*unplanned, *section, *replace))
        compared = path("baseline")
        command = ["train", batches, compared, *untrained.flags]
        plan.add("baseline", command, (batches, *read), compared, lambda: Train(batches, compared, untrained.built))


def _leaves_out(stage: _Planned) -> bool:
    """Whether the published page leaves out what this stage makes: a non-private baseline, an audit,
    or evaluations on data not declared public."""
    internal_evaluation = "--eval-data" in stage.command and "--eval-data-public" not in stage.command
    return stage.name in ("baseline", "audit") or (stage.name == "train" and internal_evaluation)


# --- a section's options ------------------------------------------------------------------------

COMMANDS = {GenerateOptions: "generate", BoundOptions: "bound", BatchOptions: "batch", TrainOptions: "train"}


class _Entry(NamedTuple):
    """A config key as its stage takes it: the option it sets, its value as the command line parses the
    value's text, and its flag (with that text) in the stage's command."""

    option: Declared
    value: Any
    flags: tuple[str, ...]


def _read(
    section: str, declaration: type, options: Iterable[tuple[str, Any]], takes_runner_options: bool = False
) -> list[_Entry]:
    """A section's keys and values as options of `declaration`'s command: a key is an option's name, true
    a switch given, a list comma-separated, null left out; each value's text is parsed as the option's flag
    parses it (its declared type, parse and choices). `takes_runner_options`: the stage also takes its
    runner's options (in runner_options), which an unknown key may have meant."""
    known = {each.name: each for each in declared(declaration)}
    entries = []
    for key, value in options:
        each = known.get(key)
        if each is None:
            names = sorted([*known, *(RUNNER_STAGE_OPTIONS if takes_runner_options else ())])
            hint = "; a runner option, madp's --partitions among them, goes in runner_options"
            raise InputError(
                f"config {section}.{key}: not an option of `madp {COMMANDS[declaration]}` "
                f"(known: {', '.join(names)}){hint if takes_runner_options else ''}"
            )
        flag = max(each.flags, key=len)
        if each.switch:
            if not isinstance(value, bool):
                raise InputError(f"config {section}.{key}: true or false")
            entries += [_Entry(each, True, (flag,))] if value else []
        elif value is not None:
            text = ",".join(map(str, value)) if isinstance(value, list) else str(value)
            parse = each.parse or str
            try:
                parsed = parse(text)
            except argparse.ArgumentTypeError as error:  # a parse that says what it takes (a seed's range)
                raise InputError(f"config {section}.{key}: {error}") from None
            except ValueError:
                name = getattr(parse, "__name__", "a value")
                raise InputError(f"config {section}.{key}: expected {name}, got {value!r}") from None
            choices = each.option.choices
            if choices and parsed not in choices:
                raise InputError(f"config {section}.{key}: one of {', '.join(map(str, choices))}, got {value!r}")
            entries.append(_Entry(each, parsed, (flag, text)))
    return entries


class _Options(Generic[Declaration]):
    """A stage's options as the config gives them, in the order of its command's flags; `built` once."""

    def __init__(self, declaration: type[Declaration], entries: Iterable[_Entry]) -> None:
        self.declaration = declaration
        self.entries = tuple(entries)

    @property
    def flags(self) -> list[str]:
        return [token for entry in self.entries for token in entry.flags]

    def then(self, entries: Iterable[_Entry]) -> _Options[Declaration]:
        return _Options(self.declaration, (*self.entries, *entries))

    def _last(self, name: str) -> _Entry | None:
        """The entry of the declared option `name` that holds (the last given), if any."""
        if name not in self._names:
            raise KeyError(f"{name}: no option of {self.declaration.__name__}")
        return next((entry for entry in reversed(self.entries) if entry.option.name == name), None)

    @functools.cached_property
    def _names(self) -> frozenset[str]:
        return frozenset(each.name for each in declared(self.declaration))

    def value(self, name: str) -> Any:
        """The value of option `name` as its flag parses it (None: not given), before the options are built."""
        entry = self._last(name)
        return None if entry is None else entry.value

    def flags_of(self, name: str) -> list[str]:
        """Option `name`'s flag and value's text as the stage's command gives them ([]: not given)."""
        entry = self._last(name)
        return [] if entry is None else list(entry.flags)

    def default(self, name: str) -> Any:
        """Option `name`'s declared default."""
        return next(each.default for each in declared(self.declaration) if each.name == name)

    @functools.cached_property
    def built(self) -> Declaration:
        """The options object (checked as it is built), or an error as the command line gives it: the first
        value it would take for an option, a required option left out, or what the declaration refuses."""
        command = COMMANDS[self.declaration]
        values: dict[str, Any] = {}
        for entry in self.entries:
            each = entry.option
            if len(entry.flags) > 1 and _taken_for_option(entry.flags[1]):
                raise InputError(f"madp {command}: error: argument {'/'.join(each.flags)}: expected one argument")
            if each.option.repeatable:  # given once per value
                values[each.name] = (*values.get(each.name, each.default), entry.value)
            else:  # given again: the last value holds
                values[each.name] = entry.value
        missing = [
            "/".join(each.flags) for each in declared(self.declaration) if each.required and each.name not in values
        ]
        if missing:
            raise InputError(f"madp {command}: error: the following arguments are required: {', '.join(missing)}")
        return self.declaration(**values)


def _own_flags(declaration: type) -> tuple[str, ...]:
    """The flags of a bound or batch stage's command: its declared options', its runner's and its help's."""
    declared_flags = (flag for each in declared(declaration) for flag in each.flags)
    return (*declared_flags, *(flag for flags in RUNNER_STAGE_OPTIONS.values() for flag in flags), *HELP_FLAGS)


def _taken_for_option(text: str) -> bool:
    """Whether the command line takes `text` for an option rather than a value: it starts with '-' but is no
    negative number, nor holds a space (as argparse reads it)."""
    return len(text) > 1 and text.startswith("-") and not NEGATIVE_NUMBER.match(text) and " " not in text


def _madp_option_in(runner_options: Sequence[str], own: Sequence[str]) -> str | None:
    """The first of `runner_options` that argparse would take as one of the `own` options of the madp command
    itself (exactly, abbreviated, or a short option with its value attached), if any."""
    for option in runner_options:
        name = option.split("=", 1)[0]
        if name in own or any(
            flag.startswith(name) if name.startswith("--") else name.startswith(flag) for flag in own if len(name) > 1
        ):
            return name
    return None


def _checked(stage: _Planned) -> Stage:
    """The stage with its step, built: its runner options none of its command's own, its options as its
    command builds them, its output apart from what it reads."""
    if stage.own_flags:
        option = _madp_option_in([o for o in stage.runner_options if o.startswith("-")], stage.own_flags)
        if option is not None:
            raise InputError(
                f"config {stage.name}.runner_options: {option} is an option of madp {stage.name}, not of the "
                f"runner: set it as a key of the {stage.name} section, where the config check sees it"
            )
    try:
        step = stage.make()
        if not stage.name.startswith("verify-"):  # a verifier writes nothing: its output is the folder it checks
            storage.refuse_overlap(stage.output, [*stage.inputs, *step.reads])
    except InputError as error:
        raise InputError(f"config {stage.name}: {error_text(error)}") from error
    return Stage(stage.name, stage.command, stage.inputs, stage.output, step)
