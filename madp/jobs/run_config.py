"""`madp run CONFIG.yaml`, its config: the YAML file (with `--set` overrides) read into a `RunConfig`, the
section of each stage it runs, `madp run`'s own keys in them (`runner`, `runner_options`, `holdout`, `baseline`)
taken out and checked; the other keys of a section stay as the config gives them, read as the options of the
stage's `madp` command when the stages are planned (`madp.jobs.run_plan`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Self

import yaml

from madp.core.errors import InputError
from madp.tools.planning.audit_config import AuditOptions, audit_options

SECTIONS = ("run_dir", "input", "generate", "bound", "batch", "calibrate", "train", "audit", "report")

Items = tuple[tuple[str, Any], ...]  # a section's keys and values, in the config's order


@dataclasses.dataclass(frozen=True)
class Section:
    """A stage's section: its keys, each an option of the stage's `madp` command by name, with their
    values as the config gives them (a list for a comma-separated option, true for a switch given)."""

    options: Items = ()

    @property
    def names(self) -> frozenset[str]:
        """The options the section sets."""
        return frozenset(name for name, _ in self.options)

    @property
    def sets_nothing(self) -> bool:
        """Whether the section sets no option and leaves `madp run`'s own keys at their defaults (`{}`)."""
        return self == type(self)()

    def value(self, name: str) -> Any:
        """The value the section gives option `name` as the config writes it (None: not given), for a check
        made before the section's options are read (`audited`)."""
        return next((value for key, value in reversed(self.options) if key == name), None)

    def with_options(self, options: Items) -> Self:
        """The section with `options` set: an option it gives takes the new value in its place, the others
        follow its own."""
        return dataclasses.replace(self, options=tuple({**dict(self.options), **dict(options)}.items()))


@dataclasses.dataclass(frozen=True)
class GenerateSection(Section):
    """The generate section; `holdout`: also write run_dir/test.parquet, the held-out records."""

    holdout: bool = False  # also write run_dir/test.parquet, the held-out records (the train section's eval data)


@dataclasses.dataclass(frozen=True)
class RunnerSection(Section):
    """A bound or batch section: the stage runs on `runner` (a Beam runner, "pyspark" or "local"), given
    `runner_options`, the runner's own options argv-style (Beam's pipeline options, or madp's Spark options)."""

    runner: str = "DirectRunner"  # the stage's runner: local (in memory), pyspark, or a Beam runner by name
    # the runner's options, a list: Beam's (`[--partitions, 32]`), or Spark's with runner pyspark
    runner_options: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class TrainSection(Section):
    """The train section; `baseline`: also train a non-private model on the same batches."""

    baseline: bool = False  # also train a non-private model on the same batches (run_dir/baseline/, internal)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A `madp run` config: where the run writes, its records (`input`, or a generate section that makes
    them), the section of each stage it runs (None: not run), the audit section's keys and whether the run
    ends with its report page."""

    run_dir: str  # the directory of the run's outputs (required)
    input: str | None = None  # the records (a file or folder of .jsonl/.parquet/.csv), unless generate makes them
    generate: GenerateSection | None = None  # synthetic records instead of input: `madp generate`'s options
    bound: RunnerSection | None = None  # contribution bounding: `madp bound`'s options
    batch: RunnerSection | None = None  # the training batches: `madp batch`'s options
    calibrate: Section | None = None  # the privacy plan: `madp train`'s privacy options
    train: TrainSection | None = None  # the private model: `madp train`'s other options
    audit: Section | None = None  # an audit of the trained model: `madp audit`'s options (`AuditOptions`)
    report: bool = False  # true: end with run_dir/report.html (and internal-report.html), `madp report`'s pages

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RunConfig:
        """The config of a YAML document's mapping, its top level and `madp run`'s own keys checked."""
        unknown = sorted(set(data) - set(SECTIONS))
        if unknown:
            raise InputError(f"config: unknown key(s) {', '.join(unknown)} (known: {', '.join(SECTIONS)})")
        run_dir = data.get("run_dir")
        if not isinstance(run_dir, str) or not run_dir:
            raise InputError("config run_dir: required, the directory of the run's outputs")
        generate, bound, batch, calibrate, train = (
            _mapping(data, name) for name in ("generate", "bound", "batch", "calibrate", "train")
        )
        records = data.get("input")
        if generate is not None and records is not None:
            raise InputError("config input: give either input or a generate section, not both")
        if generate is None and (not isinstance(records, str) or not records):
            raise InputError("config input: required (the records), unless a generate section makes them")
        audit = data.get("audit")
        if audit is not None and not isinstance(audit or {}, dict):
            raise InputError("config audit: a mapping of options (canaries, confidence, ...)")
        report = data.get("report", False)
        if not isinstance(report, bool):
            raise InputError("config report: true or false (writes run_dir/report.html from the run's reports)")
        return cls(
            run_dir=run_dir,
            input=records,
            generate=None if generate is None else _generate(generate),
            bound=None if bound is None else _runner_section(bound, "bound"),
            batch=None if batch is None else _runner_section(batch, "batch"),
            calibrate=None if calibrate is None else Section(tuple(calibrate.items())),
            train=None if train is None else _train(train),
            audit=None if audit is None else Section(tuple((audit or {}).items())),
            report=report,
        )

    @classmethod
    def read(cls, path: str, overrides: list[str]) -> RunConfig:
        """The config of a YAML file with `--set` overrides."""
        return cls.from_json(_load_config(path, overrides))


def _mapping(data: Mapping[str, Any], name: str) -> dict | None:
    value = data.get(name)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InputError(f"config {name}: a mapping of options")
    return dict(value)


def _generate(section: dict) -> GenerateSection:
    holdout = section.pop("holdout", False)
    if not isinstance(holdout, bool):
        raise InputError("config generate.holdout: true or false (writes run_dir/test.parquet)")
    return GenerateSection(tuple(section.items()), holdout)


def _runner_section(section: dict, name: str) -> RunnerSection:
    """A bound or batch section, its runner and runner options taken out."""
    if "beam_options" in section:  # a config written for Beam alone: an error naming the key, not a second name
        raise InputError(
            f"config {name}.beam_options: the runner's options (Beam's or Spark's) go in {name}.runner_options; "
            f"rename the key"
        )
    runner = section.pop("runner", "DirectRunner")
    options = section.pop("runner_options", [])
    if not isinstance(options, list) or not all(isinstance(o, (str, int, float)) for o in options):
        raise InputError(f"config {name}.runner_options: a list of the runner's options, e.g. [--partitions, 32]")
    if runner == "local" and options:
        raise InputError(f"config {name}.runner_options: runner local takes no runner options")
    return RunnerSection(tuple(section.items()), str(runner), tuple(map(str, options)))


def _train(section: dict) -> TrainSection:
    baseline = section.pop("baseline", False)
    if not isinstance(baseline, bool):
        raise InputError("config train.baseline: true or false (also trains a non-private model)")
    return TrainSection(tuple(section.items()), baseline)


def _load_config(path: str, overrides: list[str]) -> dict:
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


TEXT_MODELS = ("text-classifier", "text-lm", "causal-lm")  # models madp audit cannot score canaries with


def audited(config: RunConfig, given: Mapping[str, Any]) -> AuditOptions:
    """The options of the audit of the config's model: its audit section's, overridden by the options `given`
    on the command line (those not None); the model must be one the audit can plant canaries in."""
    bound, batch, calibrate, train = config.bound, config.batch, config.calibrate, config.train
    if any(section is None or section.sets_nothing for section in (bound, batch, calibrate, train)) or train is None:
        raise InputError(
            "config: an audit trains the config's model, so it needs bound, batch, calibrate and train sections"
        )
    model = train.value("model")
    if str(model or "") in TEXT_MODELS:
        raise InputError(
            f"config train.model {model}: madp audit scores canaries with a numeric model "
            f"(logreg, mlp, module:function); text models cannot be audited yet"
        )
    inputs = train.value("inputs") or ()  # a list, or `a,b` as its flag takes it
    if len(inputs if isinstance(inputs, list) else str(inputs).split(",")) > 1:
        raise InputError(
            f"config train.inputs {inputs}: the audit plants its canaries in one features vector; "
            f"a model of several inputs cannot be audited"
        )
    return audit_options(dict(config.audit.options) if config.audit else {}, given)
