"""`madp run CONFIG.yaml`, planning: a config becomes the stages it runs, generate -> bound -> batch
-> calibrate -> train (and audit), each optional (its section present or not).

A section's keys are the long options of the `madp` command the stage runs (`max_contributions:
3` is `--max-contributions 3`), so the config and the CLI never drift apart; `runner` and
`beam_options` go to Beam. The whole config is parsed and every stage's options are built before
anything runs.

Run directory layout: records/ and test.parquet (generate), bound/, batches/ (with the
independent verifiers run after each), calibration.json (the privacy plan the trainer uses),
train/, baseline/ (non-private, if asked), report.html (publishable) and internal-report.html (with
the baseline, the audit or evaluations on data not declared public; never published), and .madp/
with one manifest per finished stage (set aside as STAGE.pending.json while the stage runs again).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import logging
from collections.abc import Mapping

import yaml

from madp.commands.registry import CommandParser, Parser, error_text, read_paths
from madp.core import storage
from madp.core.errors import InputError
from madp.core.options import CALIBRATE, how_only_flags, section_keys
from madp.core.records import users_columns_of
from madp.core.selection import largest_capacity
from madp.tools.planning.audit_config import audit_directory, audit_options
from madp.training.options import TrainOptions

log = logging.getLogger("madp.run")
# Keys of the calibrate section: the privacy options of `madp train`; the rest of them are the train section's.
CALIBRATE_KEYS = section_keys(TrainOptions, CALIBRATE)
INTERNAL_REPORT = "internal-report.html"  # the page with the baseline and the realized sampling: never published
SECTIONS = ("run_dir", "input", "generate", "bound", "batch", "calibrate", "train", "audit", "report")
# Options of a madp command that say only how a stage reaches its outputs, never what they are, by flag with the
# number of values each takes (`option(how_only=True)`): left out of the stage's parameters (`Stage.parameters`,
# what `madp run` fingerprints), so that a re-run that sets them otherwise finds the outputs up to date instead
# of training once more.
HOW_ONLY = {"train": how_only_flags(TrainOptions)}


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str
    command: list[str]  # the `madp` command line it runs
    inputs: tuple[str, ...]  # paths whose files it reads
    output: str  # the path it writes (a directory, or calibration.json)

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


def load_config(path: str, overrides: list[str]) -> dict:
    """The YAML config with `--set key.sub=value` overrides (values parsed as YAML)."""
    try:
        with open(path) as handle:
            config = yaml.safe_load(handle) or {}
    except (OSError, yaml.YAMLError) as error:
        raise InputError(f"config {path}: {error}") from error
    if not isinstance(config, dict):
        raise InputError(f"config {path}: the top level must be a mapping of sections")
    for override in overrides:
        key, sep, value = override.partition("=")
        if not sep or not key:
            raise InputError(f"--set {override!r}: expected key=value or section.key=value")
        *sections, leaf = key.split(".")
        node = config
        for section in sections:
            node = node.setdefault(section, {})
            if not isinstance(node, dict):
                raise InputError(f"--set {override!r}: {section} is not a section")
        node[leaf] = yaml.safe_load(value)
    return config


def plan_stages(config: dict, parser: Parser, source: tuple[str, list[str]] | None = None) -> list[Stage]:
    """Validate the config and return the stages it asks for, in order. `source` (the config file and its
    `--set` overrides) is what an audit stage re-reads; without it the audit section is only validated."""
    unknown = sorted(set(config) - set(SECTIONS))
    if unknown:
        raise InputError(f"config: unknown key(s) {', '.join(unknown)} (known: {', '.join(SECTIONS)})")
    run_dir = config.get("run_dir")
    if not isinstance(run_dir, str) or not run_dir:
        raise InputError("config run_dir: required, the directory of the run's outputs")
    plan = _Plan(run_dir, parser.commands)
    data, eval_data = _data_stages(config, plan)
    _bound_stages(config, plan, data)
    _batch_stages(config, plan, data)
    _training_stages(config, plan, eval_data)
    if isinstance(config.get("input"), str):  # a stage would replace, or read back, the user's records
        for stage in plan.stages:
            try:
                storage.refuse_overlap(stage.output, [config["input"]])
            except InputError as error:
                raise InputError(f"config input: stage {stage.name}: {error}") from None
    if config.get("audit") is not None:
        directory = audit_directory(config, audit_options(config, {}))
        if source is not None:
            config_path, overrides = source
            command = ["audit", config_path, *(flag for o in overrides for flag in ("--set", o))]
            plan.stages.append(Stage("audit", command, (config_path, data), directory))
    report = config.get("report", False)
    if not isinstance(report, bool):
        raise InputError("config report: true or false (writes run_dir/report.html from the run's reports)")
    if report:
        outputs = tuple(stage.output for stage in plan.stages)
        plan.stages.append(Stage("report", ["report", run_dir], outputs, plan.path("report.html")))
        if any(_leaves_out(stage) for stage in plan.stages):  # what the published page leaves out
            internal = plan.path(INTERNAL_REPORT)
            command = ["report", run_dir, "--internal", "--output", internal]
            plan.stages.append(Stage("internal-report", command, outputs, internal))
    for stage in plan.stages:  # every stage's options parse and build before anything runs
        _check(parser, stage)
    return plan.stages


@dataclasses.dataclass
class _Plan:
    """The stages planned so far, and where a run's outputs go."""

    run_dir: str
    commands: Mapping[str, CommandParser]
    stages: list[Stage] = dataclasses.field(default_factory=list)

    def path(self, name: str) -> str:
        return storage.join(self.run_dir, name)


def _data_stages(config: dict, plan: _Plan) -> tuple[str, str | None]:
    """(the records, the held-out records or None): the config's input, or a generate stage."""
    generate = _section(config, "generate")
    data = config.get("input")
    eval_data = None
    if generate is not None:
        if data is not None:
            raise InputError("config input: give either input or a generate section, not both")
        holdout = generate.pop("holdout", False)
        if not isinstance(holdout, bool):
            raise InputError("config generate.holdout: true or false (writes run_dir/test.parquet)")
        data = plan.path("records")
        extra = ["--holdout", plan.path("test.parquet")] if holdout else []
        eval_data = plan.path("test.parquet") if holdout else None
        flags = _flags(plan.commands["generate"], "generate", generate)
        plan.stages.append(Stage("generate", ["generate", data, *flags, *extra], (), data))
    if not isinstance(data, str) or not data:
        raise InputError("config input: required (the records), unless a generate section makes them")
    return data, eval_data


def _bound_stages(config: dict, plan: _Plan, data: str) -> None:
    bound = _section(config, "bound")
    if bound is None:
        return
    path = plan.path
    beam = _beam(bound, "bound")
    flags = _flags(plan.commands["bound"], "bound", bound, beam=True)
    read = (data, bound["capacities"]) if bound.get("capacities") else (data,)  # an edited capacities file re-runs
    plan.stages.append(Stage("bound", ["bound", data, path("bound"), *flags, *beam], read, path("bound")))
    if "max_contributions" not in bound:
        raise InputError("config bound.max_contributions: required (the contribution bound K)")
    k = ["--max-contributions", str(bound["max_contributions"])]
    capacities = ["--capacities", bound["capacities"]] if bound.get("capacities") else []
    columns = _pick(flags, ("--id-column", "--users-column", "--users-columns", "--user-ids"))
    plan.stages.append(
        Stage(
            "verify-bound",
            ["verify-bound", data, path("bound"), *k, *capacities, *columns],
            (data, path("bound")),
            path("bound"),
        )
    )


def _batch_stages(config: dict, plan: _Plan, data: str) -> None:
    """batch, then verify-batches against the bound's selection and contribution bound; both read the
    records with the bound's id and users columns and its user_ids (a batch section may only repeat them)."""
    batch = _section(config, "batch")
    if batch is None:
        return
    bound = _section(config, "bound")
    if bound is None:
        raise InputError(
            "config batch: needs a bound section (the batches are made from its selection, and verify-batches "
            "checks them against its contribution bound)"
        )
    columns = []
    for key, used in _bound_columns(bound).items():
        if key in batch and _column_value(key, batch.pop(key)) != used:
            raise InputError(
                f"config batch.{key}: differs from the bound's ({used!r}): batch and verify-batches read the "
                f"records with the columns the bound read; leave batch.{key} out"
            )
        columns += [f"--{key.replace('_', '-')}", used]
    if "user_ids" in batch:  # left: the bound section has none
        raise InputError(
            "config batch.user_ids: the bound section says how user ids are read (bound.user_ids): batch and "
            "verify-batches read them as the bound did; leave batch.user_ids out"
        )
    other = sorted({"users_column", "users_columns"} & set(batch))  # left: the users option the bound did not use
    if other:
        bound_key = next(key for key in _bound_columns(bound) if key != "id_column")
        raise InputError(
            f"config batch.{other[0]}: the bound reads the users with {bound_key}: batch and verify-batches read "
            f"the records with the columns the bound read; leave batch.{other[0]} out"
        )
    path = plan.path
    beam = _beam(batch, "batch")
    flags = _flags(plan.commands["batch"], "batch", batch, beam=True)
    plan.stages.append(
        Stage(
            "batch",
            ["batch", path("bound"), data, path("batches"), *flags, *columns, *beam],
            (path("bound"), data),
            path("batches"),
        )
    )
    checks = ["--min-sep", str(batch.get("min_sep", 1))]
    if batch.get("max_batch_size"):
        checks += ["--max-batch-size", str(batch["max_batch_size"])]
    checks += ["--selected", path("bound"), "--max-contributions", str(_contribution_bound(bound))]
    plan.stages.append(
        Stage(
            "verify-batches",
            ["verify-batches", path("batches"), data, *checks, *columns],
            (path("batches"), data, path("bound")),
            path("batches"),
        )
    )


def _bound_columns(bound: dict) -> dict[str, str]:
    """The bound section's id column and its users option (users_column, or users_columns as
    `a,b,c`), with their defaults, and its user_ids when given: how batch and verify-batches must read
    the records."""
    users = "users_columns" if bound.get("users_columns") is not None else "users_column"
    default = {"id_column": "id", "users_column": "users"}
    given = {key: bound[key] if bound.get(key) is not None else default.get(key) for key in ("id_column", users)}
    if bound.get("user_ids") is not None:
        given["user_ids"] = bound["user_ids"]
    return {key: _column_value(key, value) for key, value in given.items()}


def _column_value(key: str, value: object) -> str:
    """A column option's value as its flag takes it (users_columns: a list or `a,b,c`, as `a,b,c`)."""
    if key == "users_columns":
        return ",".join(users_columns_of(value if isinstance(value, (str, list, tuple)) else str(value)))
    return str(value)


def _contribution_bound(bound: dict) -> int:
    """What training accounts with: the bound section's K, or its largest capacity if larger (as
    `madp bound` reports it in `contribution_bound`)."""
    try:
        k = int(bound["max_contributions"])
    except (KeyError, TypeError, ValueError):
        raise InputError("config bound.max_contributions: required, an integer (the contribution bound K)") from None
    try:
        return largest_capacity(k, str(bound["capacities"]) if bound.get("capacities") else None)
    except InputError as error:
        raise InputError(f"config bound.capacities: {error}") from error


def _training_stages(config: dict, plan: _Plan, eval_data: str | None) -> None:
    """calibrate (the privacy plan), train with it, and the non-private baseline if asked."""
    path = plan.path
    calibrate = _section(config, "calibrate")
    train = _section(config, "train")
    if calibrate is not None:
        outside = sorted(set(calibrate) - set(CALIBRATE_KEYS))
        if outside:
            raise InputError(
                f"config calibrate: {', '.join(outside)} belong to the train section "
                f"(calibrate takes {', '.join(CALIBRATE_KEYS)})"
            )
        flags = _flags(plan.commands["train"], "calibrate", calibrate)
        command = ["train", path("batches"), path("calibration.json"), *flags]
        plan.stages.append(Stage("calibrate", command, (path("batches"),), path("calibration.json")))
    if train is None:
        return
    baseline = train.pop("baseline", False)
    if not isinstance(baseline, bool):
        raise InputError("config train.baseline: true or false (also trains a non-private model)")
    inside = sorted(set(train) & set(CALIBRATE_KEYS))
    if inside:
        raise InputError(f"config train: {', '.join(inside)} belong to the calibrate section")
    if calibrate is None:
        raise InputError("config train: needs a calibrate section (the privacy plan it trains with)")
    if eval_data and "eval_data" not in train:
        train["eval_data"] = eval_data
    flags = _flags(plan.commands["train"], "train", train)
    clip = ["--clip-norm", str(calibrate["clip_norm"])] if "clip_norm" in calibrate else []
    # files the trainings read besides the batches: a pretrained model replaced at the same path re-runs them
    read = tuple(str(train[key]) for key in ("eval_data", "pretrained") if train.get(key))
    # A changed option re-runs a training into the same folder: it replaces the earlier one's outputs
    # itself, once its checks (plan, ledger) pass, and never under resume (`madp train --replace`).
    flags.append("--replace")
    plan.stages.append(
        Stage(
            "train",
            ["train", path("batches"), path("train"), "--calibration", path("calibration.json"), *clip, *flags],
            (path("batches"), path("calibration.json"), *read),
            path("train"),
        )
    )
    if baseline:
        plan.stages.append(
            Stage(
                "baseline",
                ["train", path("batches"), path("baseline"), "--mechanism", "none", *flags],
                (path("batches"), *read),
                path("baseline"),
            )
        )


def _leaves_out(stage: Stage) -> bool:
    """Whether the published page leaves out what this stage makes: a non-private baseline, an audit,
    or evaluations on data not declared public."""
    internal_evaluation = "--eval-data" in stage.command and "--eval-data-public" not in stage.command
    return stage.name in ("baseline", "audit") or (stage.name == "train" and internal_evaluation)


def _section(config: dict, name: str) -> dict | None:
    value = config.get(name)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InputError(f"config {name}: a mapping of options")
    return dict(value)


def _beam(section: dict, name: str) -> list[str]:
    runner = section.pop("runner", "DirectRunner")
    options = section.pop("beam_options", [])
    if not isinstance(options, list) or not all(isinstance(o, (str, int, float)) for o in options):
        raise InputError(f"config {name}.beam_options: a list of Beam options, e.g. [--partitions, 32]")
    if runner == "local" and options:
        raise InputError(f"config {name}.beam_options: runner local takes no Beam options")
    return ["--runner", str(runner), *map(str, options)]


def _flags(parser: CommandParser, section: str, options: dict, beam: bool = False) -> list[str]:
    """Command-line flags of a section: key -> --key, true -> a flag, lists -> comma-separated. `beam`:
    the stage also takes Beam options (in beam_options), which an unknown key may have meant."""
    known = {dest: action for dest, action in parser.options.items() if dest != "help"}
    flags = []
    for key, value in options.items():
        action = known.get(key)
        if action is None:
            hint = "; a Beam option, madp's --partitions among them, goes in beam_options" if beam else ""
            raise InputError(
                f"config {section}.{key}: not an option of `madp {parser.prog.split()[-1]}` "
                f"(known: {', '.join(sorted(known))}){hint}"
            )
        flag = max(action.option_strings, key=len)
        if action.nargs == 0:  # a switch (store_true)
            if not isinstance(value, bool):
                raise InputError(f"config {section}.{key}: true or false")
            flags += [flag] if value else []
        elif value is not None:
            text = ",".join(map(str, value)) if isinstance(value, list) else str(value)
            convert = action.type if callable(action.type) else str
            try:
                converted = convert(text)
            except argparse.ArgumentTypeError as error:  # a type that says what it takes (a seed's range)
                raise InputError(f"config {section}.{key}: {error}") from None
            except ValueError:
                name = getattr(convert, "__name__", "a value")
                raise InputError(f"config {section}.{key}: expected {name}, got {value!r}") from None
            if action.choices and converted not in action.choices:
                raise InputError(f"config {section}.{key}: one of {', '.join(map(str, action.choices))}, got {value!r}")
            flags += [flag, text]
    return flags


def _pick(flags: list[str], names: tuple[str, ...]) -> list[str]:
    """The (flag, value) pairs of `flags` whose flag is one of `names`."""
    picked = []
    for index, flag in enumerate(flags[:-1]):
        if flag in names:
            picked += [flag, flags[index + 1]]
    return picked


def _madp_option_in(beam_options: list[str], command: CommandParser) -> str | None:
    """The first of `beam_options` that argparse would take as an option of the madp command itself
    (exactly, abbreviated, or a short option with its value attached), if any."""
    own = [flag for action in command.options.values() for flag in action.option_strings]
    for option in beam_options:
        name = option.split("=", 1)[0]
        if name in own or any(
            flag.startswith(name) if name.startswith("--") else name.startswith(flag) for flag in own if len(name) > 1
        ):
            return name
    return None


def _check(parser: Parser, stage: Stage) -> None:
    if stage.name in ("bound", "batch"):  # `_beam` put --runner RUNNER first, then the section's beam_options
        beam_options = stage.command[stage.command.index("--runner") + 2 :]
        option = _madp_option_in([o for o in beam_options if o.startswith("-")], parser.commands[stage.name])
        if option is not None:
            raise InputError(
                f"config {stage.name}.beam_options: {option} is an option of madp {stage.name}, not of Beam: "
                f"set it as a key of the {stage.name} section, where the config check sees it"
            )
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):  # argparse prints its reason, then exits
            args, extra = parser.parse_known_args(stage.command)
    except (argparse.ArgumentError, SystemExit) as error:
        reason = said.getvalue().strip().splitlines()[-1:] or [str(error)]
        raise InputError(f"config {stage.name}: {reason[0]}") from error
    if extra and stage.name not in ("bound", "batch"):
        raise InputError(f"config {stage.name}: unexpected {' '.join(extra)}")
    try:
        parser.check_options(args)
        if not stage.name.startswith("verify-"):  # a verifier writes nothing: its output is the folder it checks
            storage.refuse_overlap(stage.output, [*stage.inputs, *read_paths(args)])
    except InputError as error:
        raise InputError(f"config {stage.name}: {error_text(error)}") from error
