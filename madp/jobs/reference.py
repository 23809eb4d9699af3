"""The references generated from madp's declarations, each a page under docs/reference/ that the docs' build
(docs/_ext/madp_reference.py) and a test hold to them:

- options.md: every `madp` command (usage, description, each argument and option with its default and help),
  rendered from the command line's argparse parsers, each option with its `madp run` config key;
- config.md: every key of a `madp run` config, section by section, from `RunConfig`, its sections' own keys
  and the options' declarations each section reads;
- outputs.md: every file a stage writes (`OUTPUTS`), whether a user may publish it, and for the files that are
  a dataclass's JSON, its fields (name, type, meaning from the field's comment);
- errors.md: the command line's exit statuses (`EXIT_STATUSES`) and the errors a user meets (`InputError`
  and its subclasses, with their docstrings);
- api.md: the Python API, an autodoc entry for each name that `madp`, `madp.training`, `madp.accounting` and
  `madp.beam` export (`__all__`).

It sits with the jobs since it describes every stage's outputs and `madp run`'s config. The command line's
parser is a layer above, so `pages` is given it: `python docs/_ext/madp_reference.py` writes every page again.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import dataclasses
import importlib
import inspect
import io
import os
import re
import sys
import textwrap
import tokenize
import typing
from collections.abc import Iterator
from typing import NamedTuple

from madp.commands.accounting import CalibrateOptions, EpsilonOptions, RecommendOptions, StrategyOptions
from madp.commands.batching import VerifyBatchesOptions
from madp.commands.bounding import VerifyBoundOptions
from madp.commands.data import GenerateOptions
from madp.commands.registry import EXIT_STATUSES, Parser
from madp.commands.report import ReportOptions
from madp.core.batch_files import SCHEMA_FILE, TRAININGS_FILE, BatchSchema
from madp.core.errors import InputError
from madp.core.options import CALIBRATE, Declared, declared
from madp.core.reports import AuditReport, BatchReport, BoundReport
from madp.core.selection import REJECTED_DIR, REPORT_FILE, SELECTED_DIR, BoundOptions
from madp.engines.batching import BatchOptions
from madp.jobs.audit import AUDIT_FILE, CANARY_FILE, ZERO_OUT_FILE
from madp.jobs.run import INTERNAL_RESULTS, MANIFESTS, InternalResults
from madp.jobs.run_config import RunConfig, Section
from madp.jobs.run_plan import INTERNAL_REPORT
from madp.tools.planning.audit_config import AuditOptions
from madp.tools.planning.recommend import SWEEP_FILE, Recommendation
from madp.training.ledger import TrainingEntry
from madp.training.options import TrainOptions
from madp.training.outputs import (
    CHECKPOINTS,
    EVALUATION_FILE,
    INTERNAL_DIR,
    METRICS_FILE,
    REPLACED,
    TIMING_FILE,
    Evaluations,
    TrainingMetrics,
)
from madp.training.plan import PrivacyPlan

PAGES = os.path.join("docs", "reference")  # from the repository's root
REFERENCE = os.path.join(PAGES, "options.md")
CONFIG_REFERENCE = os.path.join(PAGES, "config.md")
OUTPUTS_REFERENCE = os.path.join(PAGES, "outputs.md")
ERRORS_REFERENCE = os.path.join(PAGES, "errors.md")
API_REFERENCE = os.path.join(PAGES, "api.md")
# The `madp run` sections that are a command's options, by the command: the declaration its keys are read as.
DECLARATIONS = (("bound", BoundOptions), ("batch", BatchOptions), ("train", TrainOptions))
# madp audit's options: a config's audit section gives their defaults, its flags override them.
AUDIT_DECLARATION = ("audit", AuditOptions)
GENERATE_DECLARATION = ("generate", GenerateOptions)
SECTION_DECLARATIONS = dict((GENERATE_DECLARATION, *DECLARATIONS, AUDIT_DECLARATION, (CALIBRATE, TrainOptions)))
# The commands whose options no `madp run` section takes by these names (its verify stages and report
# are given theirs by the run).
COMMAND_DECLARATIONS = (
    ("verify-bound", VerifyBoundOptions),
    ("verify-batches", VerifyBatchesOptions),
    ("calibrate", CalibrateOptions),
    ("epsilon", EpsilonOptions),
    ("strategy", StrategyOptions),
    ("recommend-k", RecommendOptions),
    ("report", ReportOptions),
)
REGENERATE = "python docs/_ext/madp_reference.py"
# The modules that define the errors madp reports (`InputError` and its subclasses; a test finds any other).
ERROR_MODULES = (
    "madp.core.errors",
    "madp.core.output_lock",
    "madp.accounting.calibrate",
    "madp.training.task_rows",
    "madp.training.user_tasks",
)
USAGE_WIDTH = 100  # the usage lines' width, whatever the terminal's
# The packages whose exported names (`__all__`) are the Python API, each with what it is for.
API_PACKAGES = (
    ("madp", "the steps, one function each, as the commands run them"),
    ("madp.training", "training on materialized batches: reading them, the privacy plan, the private step"),
    ("madp.accounting", "the accountant: mechanisms, calibration, epsilon, Monte Carlo accounting"),
    ("madp.beam", "bounding and batching as Apache Beam transforms, for a pipeline of one's own"),
)


def pages(madp: Parser) -> dict[str, str]:
    """Every generated page by its path from the repository's root; `madp`: the command line's parser."""
    return {
        REFERENCE: options_reference(madp),
        CONFIG_REFERENCE: config_reference(),
        OUTPUTS_REFERENCE: outputs_reference(),
        ERRORS_REFERENCE: errors_reference(),
        API_REFERENCE: api_reference(),
    }


def _generated(what: str) -> str:
    return f"Generated from {what} by `{REGENERATE}`: edit those, not this page."


# --- the commands and their options ------------------------------------------------------------------


def options_reference(madp: Parser) -> str:
    """Every command of the parser `madp` as Markdown: its usage, description, arguments and options."""
    lines = [
        "# Commands and options",
        "",
        _generated("the command line's parsers (`madp.cli.parser`)"),
        "",
        "A `madp run` config key is an option's name with underscores (`max_contributions: 3` is",
        "`--max-contributions 3`, `true` a switch), in the section the key column names; the [config",
        "reference](config.md) lists every key, those that are no option too. Commands with no key",
        "column are no `madp run` section. Where a command ends and what it prints: [errors](errors.md).",
        "",
        "## madp",
        "",
        madp.description or "",
        "",
        *_usage(madp),
        "",
        *_options_table("", madp),
        "",
        "| command | what it does |",
        "|---|---|",
    ]
    lines += [f"| [{name}](#madp-{name}) | {_cell(summary)} |" for name, summary in _summaries(madp).items()]
    for name, command in madp.commands.items():
        lines += ["", f"## madp {name}", "", _summaries(madp)[name] + ".", ""]
        if command.description:
            lines += [command.description, ""]
        lines += _usage(command)
        arguments = [action for action in command._actions if not action.option_strings]
        if arguments:
            lines += ["", "| argument | help |", "|---|---|"]
            lines += [f"| `{action.dest.upper()}` | {_cell(action.help or '')} |" for action in arguments]
        lines += ["", *_options_table(name, command)]
    return "\n".join(lines) + "\n"


def _summaries(madp: Parser) -> dict[str, str]:
    """Each command's one-line help, as `madp --help` lists it."""
    (commands,) = (action for action in madp._actions if isinstance(action, argparse._SubParsersAction))
    return {action.dest: action.help or "" for action in commands._choices_actions}


def _usage(command: argparse.ArgumentParser) -> list[str]:
    formatter = argparse.HelpFormatter(command.prog, width=USAGE_WIDTH)
    formatter.add_usage(command.usage, command._actions, command._mutually_exclusive_groups)
    return ["```text", formatter.format_help().strip(), "```"]


def _options_table(name: str, command: argparse.ArgumentParser) -> list[str]:
    """The command's options: flags, `madp run` key (for a command a section runs), default and help."""
    section = SECTION_DECLARATIONS.get(name)
    known = dict((*DECLARATIONS, AUDIT_DECLARATION, GENERATE_DECLARATION, *COMMAND_DECLARATIONS))
    declarations = {each.name: each for each in declared(known[name])} if name in known else {}
    options = [action for action in command._actions if action.option_strings]
    if section is None:
        rows = ["| option | default | help |", "|---|---|---|"]
    else:
        rows = ["| option | `madp run` key | default | help |", "|---|---|---|---|"]
    for action in options:
        flags = ", ".join(f"`{flag}`" for flag in action.option_strings)
        each = declarations.get(action.dest)
        default = _default(each) if each is not None else _argparse_default(action)
        cells = [flags, default, _cell(action.help or "")]
        if section is not None:
            cells.insert(1, _key(name, action.dest, each))
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def _key(command: str, name: str, each: Declared | None) -> str:
    """The `madp run` key of a command's option, if a section takes it."""
    if each is not None:
        return f"`{CALIBRATE if each.option.section == CALIBRATE else command}.{name}`"
    if name in _own_keys(command):
        return f"`{command}.{name}`"
    return ""


def _argparse_default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    if action.default in (None, False, [], argparse.SUPPRESS):
        return ""
    return f"`{action.default}`"


def _default(each: Declared) -> str:
    if each.default is dataclasses.MISSING:
        return "required"
    if each.switch or each.default in (None, ()):
        return ""
    return f"`{each.default or repr(each.default)}`"  # '' shown as such


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


# --- madp run's config ---------------------------------------------------------------------------------


def _section_class(name: str) -> type[Section] | None:
    """The class of `RunConfig`'s section `name` (None: a key that is no section)."""
    hint = {field.name: field.type for field in dataclasses.fields(RunConfig)}[name]
    found = re.match(r"(\w+) \| None$", str(hint))
    section = getattr(sys.modules[RunConfig.__module__], found.group(1)) if found else None
    return section if isinstance(section, type) and issubclass(section, Section) else None


def _own_keys(name: str) -> dict[str, dataclasses.Field]:
    """The keys that section `name` takes besides its command's options (`runner`), as its class's fields."""
    section = _section_class(name) if name in SECTION_DECLARATIONS else None
    if section is None:
        return {}
    return {field.name: field for field in dataclasses.fields(section) if field.name != "options"}


def _section_options(name: str) -> Iterator[Declared]:
    """The declared options that section `name` reads (train's privacy options are calibrate's)."""
    own = _own_keys(name)
    for each in declared(SECTION_DECLARATIONS[name]):
        in_calibrate = each.option.section == CALIBRATE
        if each.name not in own and in_calibrate == (name == CALIBRATE):
            yield each


def config_reference() -> str:
    """Every key of a `madp run` config as Markdown: the top level's, then each section's."""
    meanings = field_comments(RunConfig)
    lines = [
        "# madp run config",
        "",
        _generated("`madp.jobs.run_config.RunConfig`, its sections and the options' declarations"),
        "",
        "A config is a YAML mapping; `madp run CONFIG.yaml --set SECTION.KEY=VALUE` overrides a key (the value",
        "read as YAML). A section present runs its stage; a section's key is its command's option by name",
        "([commands and options](options.md)), a list for a comma-separated or repeatable option, `true` for a",
        "switch. A key left out takes the option's default.",
        "",
        "| key | meaning |",
        "|---|---|",
    ]
    for field in dataclasses.fields(RunConfig):
        name = f"[`{field.name}`](#{field.name})" if field.name in SECTION_DECLARATIONS else f"`{field.name}`"
        lines.append(f"| {name} | {_cell(meanings[field.name])} |")
    for field in dataclasses.fields(RunConfig):
        if field.name not in SECTION_DECLARATIONS:
            continue
        lines += ["", f"## {field.name}", "", "| key | flag | default | meaning |", "|---|---|---|---|"]
        for key, own in _own_keys(field.name).items():
            meaning = field_comments(_section_class(field.name) or Section)[key]
            shown = f"`{list(own.default) if isinstance(own.default, tuple) else own.default}`"
            lines.append(f"| `{key}` |  | {shown} | {_cell(meaning)} |")
        for each in _section_options(field.name):
            lines.append(f"| `{each.name}` | `{each.flags[0]}` | {_default(each)} | {_cell(each.option.help or '')} |")
    return "\n".join(lines) + "\n"


# --- exit statuses and errors -------------------------------------------------------------------------


def errors_reference() -> str:
    """The command line's exit statuses and the errors it reports, as Markdown."""
    lines = [
        "# Errors and exit statuses",
        "",
        _generated("`madp.commands.registry.EXIT_STATUSES` and the error classes' docstrings"),
        "",
        "| status | when | prints |",
        "|---|---|---|",
    ]
    lines += [f"| {each.code} | {_cell(each.when)} | {_cell(each.prints)} |" for each in EXIT_STATUSES]
    lines += [
        "",
        "## Errors",
        "",
        "Every error madp reports to a user is an `InputError` (a `ValueError`), raised by the Python API as by",
        "the command line, which prints it as one line and exits 2 (a `CheckFailed`: 1). Its message names the",
        "file, row, option or output and says why; a Python caller's names the parameters as keyword arguments,",
        "the command line's as flags.",
        "",
        "```{eval-rst}",
    ]
    for error in _error_classes():
        lines += [f".. autoexception:: {error.__module__}.{error.__qualname__}", "   :show-inheritance:", ""]
    lines[-1] = "```"
    return "\n".join(lines) + "\n"


def _error_classes() -> list[type]:
    """`InputError` and its subclasses in `ERROR_MODULES`, each after its base."""
    defined = [
        each
        for module in map(importlib.import_module, ERROR_MODULES)
        for each in vars(module).values()
        if isinstance(each, type) and issubclass(each, InputError) and each.__module__ == module.__name__
    ]
    found: list[type] = []

    def visit(error: type) -> None:
        found.append(error)
        for each in defined:
            if each.__bases__[0] is error:
                visit(each)

    visit(InputError)
    return found


# --- the Python API -----------------------------------------------------------------------------------


def api_reference() -> str:
    """The Python API page: an autodoc entry for every name each of `API_PACKAGES` exports, then one for each
    madp class their annotations name (what they take and return), so that every reference resolves."""
    lines = [
        "# Python API",
        "",
        _generated("each package's `__all__` and the names' docstrings"),
        "",
        "[Use madp from Python](../how-to/python-api.md) shows them at work; [the types](#types) they take",
        "and return follow them.",
    ]
    exported = []
    for package, summary in API_PACKAGES:
        module = importlib.import_module(package)
        lines += ["", f"## {package}", "", f"{summary[0].upper()}{summary[1:]}.", "", "```{eval-rst}"]
        lines += [f".. currentmodule:: {package}", ""]
        for name in module.__all__:
            exported.append(getattr(module, name))
            lines += [f".. {_autodoc_kind(exported[-1])}:: {name}", ""]
        lines[-1] = "```"
    lines += ["", "## Types", "", "The classes the names above take and return.", "", "```{eval-rst}"]
    for each in _named_types(exported):
        lines += [f".. autoclass:: {each.__module__}.{each.__qualname__}", ""]
    lines[-1] = "```"
    return "\n".join(lines) + "\n"


def _autodoc_kind(value: object) -> str:
    return "autoclass" if inspect.isclass(value) else "autofunction"


class _Names(dict):
    """The names an annotation of a module's object is evaluated with: the module's own, madp's classes (a
    module may import one only for type checking), the builtins; any other name is `typing.Any`."""

    def __init__(self, module: str, classes: dict[str, type]) -> None:
        super().__init__()
        self.sources = (vars(sys.modules[module]), classes, vars(builtins))

    def __missing__(self, name: str) -> object:
        return next((source[name] for source in self.sources if name in source), typing.Any)


def _named_types(exported: list[object]) -> list[type]:
    """The madp classes that the annotations of `exported` name, and of those classes, each once, by module."""
    classes = {
        value.__name__: value
        for module in list(sys.modules.values())
        if module is not None and module.__name__.startswith("madp.")
        for value in list(vars(module).values())
        if inspect.isclass(value) and value.__module__.startswith("madp.")
    }
    found: list[type] = []
    pending = list(exported)
    while pending:
        annotated = pending.pop(0)
        names = _Names(annotated.__module__, classes)  # type: ignore[attr-defined]
        hints = dict(typing.get_type_hints(annotated, localns=names)) if inspect.isclass(annotated) else {}
        function = annotated.__init__ if inspect.isclass(annotated) else annotated
        hints.update(typing.get_type_hints(function, localns=names))
        for each in (kind for hint in hints.values() for kind in _kinds(hint)):
            if each.__module__.startswith("madp.") and each not in found and each not in exported:
                found.append(each)
                pending.append(each)
    return sorted(found, key=lambda each: (each.__module__, each.__qualname__))


def _kinds(hint: object) -> Iterator[type]:
    """The classes a type hint names, its arguments' too."""
    if inspect.isclass(hint):
        yield hint
    for argument in typing.get_args(hint):
        yield from _kinds(argument)


# --- the outputs ---------------------------------------------------------------------------------


class Output(NamedTuple):
    """A file (or, ending in "/", a folder) a stage writes below its output: `path` as `fnmatch` matches
    it, whether a user may publish it (docs/privacy.md: what may be published, and what is internal), what it
    holds, the dataclass whose `to_json()` it is (None where it is no dataclass's), and the stage whose
    output a folder is (its files are that stage's, published only where both say so)."""

    stage: str
    path: str
    published: bool
    holds: str
    schema: type | None = None
    output_of: str | None = None


# Where each stage writes, as its command names it.
ROOTS = {
    "bound": "OUTPUT (`madp bound INPUT OUTPUT`)",
    "batch": "OUTPUT (`madp batch SELECTED DATA OUTPUT`)",
    "calibrate": "PLAN (`madp train BATCHES PLAN --epsilon E ...`: no model, the plan only; `madp.calibrate`)",
    "train": "OUTPUT (`madp train BATCHES OUTPUT ...`)",
    "report": "RUN_DIR (`madp report RUN_DIR`)",
    "recommend-k": "RUN_DIR (`madp recommend-k INPUT ... --write-config JOB.yaml`: the config's run_dir)",
    "run": "RUN_DIR (`madp run CONFIG.yaml`: the config's run_dir)",
    "audit": "RUN_DIR/audit (`madp audit CONFIG.yaml`, or the run's audit stage: the job's stages run again on the "
    "records and the canaries, a second model trained on the same records)",
}
# A stage whose output also holds another's layout: the audit runs the job's stages in its own directory.
LAID_OUT_AS = {"audit": "run"}
_REJECTS = "the rows left out and why (--on-invalid skip): which records were skipped"
_SHARDS = "-*-of-*"
OUTPUTS = (
    Output(
        "bound",
        f"{SELECTED_DIR}/part{_SHARDS}.parquet",
        False,
        "the selection: columns id and copies, one row per selected record; which records were kept",
    ),
    Output(
        "bound",
        REPORT_FILE,
        False,
        "the bounding's report: the graph's unkeyed digest (it confirms a guessed graph), the selection files' "
        "SHA-256 and the full histograms",
        BoundReport,
    ),
    Output("bound", f"{REJECTED_DIR}/rejected.jsonl", False, _REJECTS),
    Output(
        "bound",
        TRAININGS_FILE,
        False,
        "the trainings ledger, written by `madp train`: each private training on the selection's batches, its "
        "output, plan and a digest of the batch files it trained on, one JSON object a line",
        TrainingEntry,
    ),
    Output(
        "batch",
        f"batches{_SHARDS}.tfrecord",
        False,
        "the batches: each step's rows (tf.train.Example) in step order; they reveal the realized sampling",
    ),
    Output("batch", SCHEMA_FILE, False, "the rows' features (dtype and shape), the steps and B_max", BatchSchema),
    Output(
        "batch",
        REPORT_FILE,
        False,
        "the batching's report: the realized batch sizes and participations, and the batch files' SHA-256",
        BatchReport,
    ),
    Output("batch", f"{REJECTED_DIR}/rejected.jsonl", False, _REJECTS),
    Output(
        "calibrate",
        "",
        True,
        "the privacy plan for these batches, with the sigma-epsilon curve (`epsilon_curve`); a non-private "
        'training\'s is {"mechanism": "none", "private": false}',
        PrivacyPlan,
    ),
    Output("train", "model.keras", True, "the trained model (its zip entries dated 1980-01-01: no clock time)"),
    Output(
        "train",
        METRICS_FILE,
        True,
        "what the training ran with and, with --eval-data-public only, its evaluations",
        TrainingMetrics,
    ),
    Output(
        "train",
        "privacy.json",
        True,
        "the privacy plan trained with, where the noise came from, whether the model is private, and any "
        'composition with earlier trainings; a non-private training\'s is {"mechanism": "none", "private": false}',
        PrivacyPlan,
    ),
    Output(
        "train",
        "logs/events.out.tfevents.*",
        True,
        "TensorBoard scalars: epsilon spent, the learning rate, "
        "and the evaluations with --eval-data-public; stamped with steps, no clock time",
    ),
    Output("train", f"{INTERNAL_DIR}/NOTICE.txt", False, "what internal/ holds and why no one may publish it"),
    Output(
        "train",
        f"{INTERNAL_DIR}/{EVALUATION_FILE}",
        False,
        "the evaluations on --eval-data not declared public: computed without noise on records no guarantee covers",
        Evaluations,
    ),
    Output(
        "train",
        f"{INTERNAL_DIR}/{TIMING_FILE}",
        False,
        "the wall time and steps per second, which depend on the rows the secret sampling drew and on their content",
    ),
    Output(
        "train",
        f"{INTERNAL_DIR}/logs/events.out.tfevents.*",
        False,
        "TensorBoard scalars computed without "
        "noise: training loss, clipped fraction, gradient norms (--internal-scalars), internal evaluations",
    ),
    Output(
        "train",
        f"{INTERNAL_DIR}/{CHECKPOINTS}/",
        False,
        "an interrupted training's checkpoint, until it "
        "finishes: the model, the optimizer and BandMF's last noise vectors",
    ),
    Output(
        "train",
        f"{INTERNAL_DIR}/{REPLACED}/",
        False,
        "while a --replace training runs, the training it replaces, each file at its place",
    ),
    Output("train", f"{REJECTED_DIR}/rejected.jsonl", False, "the rows the model could not use: record, reason, rows"),
    Output("train", f"{REJECTED_DIR}/counts.json", False, "those rows counted by reason"),
    Output(
        "report",
        "report.html",
        True,
        "the HTML report of the run (`--output FILE` writes it elsewhere); the "
        "realized sampling is left off wherever the guarantee relies on its secrecy. With `--internal` it shows "
        "it, the baseline and the internal evaluations, is marked not for publication and is internal",
    ),
    Output(
        "recommend-k",
        SWEEP_FILE,
        True,
        "the k sweep the config was written from: a function of the graph and "
        "the public parameters only; `madp report` plots it",
        Recommendation,
    ),
    Output("run", "records/", False, "generate: the records (the private data itself)"),
    Output("run", "test.parquet", False, "generate with holdout: the held-out records, the train section's eval data"),
    Output("run", "bound/", False, "the bound stage's OUTPUT", output_of="bound"),
    Output("run", "batches/", False, "the batch stage's OUTPUT", output_of="batch"),
    Output("run", "calibration.json", True, "the calibrate stage's PLAN", output_of="calibrate"),
    Output("run", "train/", True, "the train stage's OUTPUT (published but for its internal files)", output_of="train"),
    Output(
        "run",
        "baseline/",
        False,
        "the non-private baseline, a train stage's OUTPUT: it saw the records without noise",
        output_of="train",
    ),
    Output("run", "report.html", True, "the report stage's page (report, above)"),
    Output(
        "run",
        INTERNAL_REPORT,
        False,
        "the page with the baseline, the realized sampling and the internal evaluations (`madp report --internal`)",
    ),
    Output(
        "run",
        INTERNAL_RESULTS,
        False,
        "the baseline's metrics, the private-over-non-private ratio, the internal "
        "evaluations and each stage's wall time",
        InternalResults,
    ),
    Output("run", SWEEP_FILE, True, "where `madp recommend-k` wrote the config: its sweep (recommend-k, above)"),
    Output("run", "audit/", False, "the audit stage's directory", output_of="audit"),
    Output(
        "run",
        f"{MANIFESTS}/",
        False,
        "each stage's manifest: the digest of its command line and of its "
        "inputs' contents (SHA-256), which resumes the run",
    ),
    Output("audit", "input/records-*", False, "the run's record files, linked (or copied)"),
    Output("audit", f"input/{CANARY_FILE}", False, "the canaries' records"),
    Output("audit", ZERO_OUT_FILE, False, "the ids of the canary records trained with weight 0 (`--zero-out`)"),
    Output(
        "audit",
        AUDIT_FILE,
        False,
        "the canaries, guesses, the epsilon lower bound and its confidence, the claim, "
        "every plan tried and each canary's score (published only with the model's claim composed: `madp audit`)",
        AuditReport,
    ),
)


def outputs_reference() -> str:
    """The outputs reference as Markdown: each stage's files, then the fields of each dataclass a file is."""
    lines = [
        "# Outputs",
        "",
        "Generated from the outputs' declaration (`madp.jobs.reference.OUTPUTS`) and the dataclasses the",
        f"files are the JSON of, by `{REGENERATE}`: edit those, not this page.",
        "",
        "**published**: a user may publish it (covered by the guarantee, or a function of the public graph and",
        "parameters); **internal**: never publish it ([privacy and threat model](../privacy.md)). A",
        "folder's files are of its kind; one that is another stage's output links to that stage's table, and a",
        "file there is published only where both say so. A JSON file typed below holds its class's `to_json()`:",
        "the class's fields by name (a report's `format_version` beside them), except where a meaning says",
        "otherwise.",
    ]
    for stage, root in ROOTS.items():
        also = (
            f", laid out as [{LAID_OUT_AS[stage]}](#{LAID_OUT_AS[stage]})'s beside these"
            if stage in LAID_OUT_AS
            else ""
        )
        lines += [
            "",
            f"## {stage}",
            "",
            f"Below {root}{also}.",
            "",
            "| file | status | holds | schema |",
            "|---|---|---|---|",
        ]
        lines += [_output_row(each) for each in OUTPUTS if each.stage == stage]
    lines += ["", "## Schemas"]
    for schema in schemas():
        lines += _schema_section(schema)
    return "\n".join(lines) + "\n"


def _output_row(each: Output) -> str:
    name = f"`{each.path}`" if each.path else "PLAN"
    kind = "published" if each.published else "internal"
    schema = f"[`{each.schema.__name__}`](#{each.schema.__name__.lower()})" if each.schema else ""
    holds = f"{each.holds}: [{each.output_of}](#{each.output_of})" if each.output_of else each.holds
    return f"| {name} | {kind} | {_cell(holds)} | {schema} |"


def schemas() -> list[type]:
    """The declared schemas and the dataclasses of their fields defined beside them, each once, in order."""
    found: list[type] = []

    def visit(schema: type) -> None:
        if schema in found:
            return
        found.append(schema)
        for field in dataclasses.fields(schema):
            for nested in _dataclasses_named(schema, str(field.type)):
                visit(nested)

    for each in OUTPUTS:
        if each.schema is not None:
            visit(each.schema)
    return found


def _dataclasses_named(owner: type, annotation: str) -> list[type]:
    """The dataclasses of `owner`'s module that an annotation names."""
    namespace = vars(sys.modules[owner.__module__])
    named = [namespace.get(name) for name in re.findall(r"[A-Za-z_]\w*", annotation)]
    return [
        each
        for each in named
        if isinstance(each, type) and dataclasses.is_dataclass(each) and each.__module__ == owner.__module__
    ]


def _schema_section(schema: type) -> list[str]:
    summary = " ".join((inspect.getdoc(schema) or "").split("\n\n")[0].split())  # the docstring's first paragraph
    meanings = field_comments(schema)
    lines = ["", f"### {schema.__name__}", "", f"`{schema.__module__}.{schema.__qualname__}`: {summary}", ""]
    lines += ["| field | type | meaning |", "|---|---|---|"]
    for field in dataclasses.fields(schema):
        lines.append(f"| `{field.name}` | `{_cell(str(field.type))}` | {_cell(meanings.get(field.name, ''))} |")
    return lines


def field_comments(schema: type) -> dict[str, str]:
    """Each field's comment in the class's source: the one on its line, else the comment lines right above it."""
    source = textwrap.dedent(inspect.getsource(schema))
    lines = source.splitlines()
    comments = {
        token.start[0]: token.string.lstrip("#").strip()
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    }
    (definition,) = ast.parse(source).body
    assert isinstance(definition, ast.ClassDef)
    found = {}
    for statement in definition.body:
        if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
            continue
        end = statement.end_lineno or statement.lineno
        on_line = [comments[n] for n in range(statement.lineno, end + 1) if n in comments]
        above: list[str] = []
        line = statement.lineno - 1
        while line in comments and lines[line - 1].lstrip().startswith("#"):
            above.insert(0, comments[line])
            line -= 1
        found[statement.target.id] = on_line[0] if on_line else " ".join(above)
    return found
