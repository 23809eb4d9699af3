"""The references generated from madp's declarations, each a page a test holds to them:

- docs/reference/options.md: every declared option of `madp bound`, `madp batch` and `madp train` (flag,
  default, help) with its `madp run` section key, and of the commands `madp run` does not run as stages of
  their own (the accountant's, the verifiers', the report's), rendered from the options' dataclasses;
- docs/reference/outputs.md: every file a stage writes (`OUTPUTS`), whether a user may publish it, and
  for the files that are a dataclass's JSON, its fields (name, type, meaning from the field's comment).

It sits with the jobs since it describes every stage's outputs, the jobs' too. `python -m
madp.jobs.reference` writes both pages again; a test fails while either is stale."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import os
import re
import sys
import textwrap
import tokenize
from typing import NamedTuple

from madp.commands.accounting import CalibrateOptions, EpsilonOptions, RecommendOptions, StrategyOptions
from madp.commands.batching import VerifyBatchesOptions
from madp.commands.bounding import VerifyBoundOptions
from madp.commands.report import ReportOptions
from madp.core.batch_files import SCHEMA_FILE, TRAININGS_FILE, BatchSchema
from madp.core.options import CALIBRATE, Declared, declared
from madp.core.reports import AuditReport, BatchReport, BoundReport
from madp.core.selection import REJECTED_DIR, REPORT_FILE, SELECTED_DIR, BoundOptions
from madp.engines.batching import BatchOptions
from madp.jobs.audit import AUDIT_FILE, CANARY_FILE, ZERO_OUT_FILE
from madp.jobs.run import INTERNAL_RESULTS, MANIFESTS, InternalResults
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

REFERENCE = os.path.join("docs", "reference", "options.md")  # from the repository's root
OUTPUTS_REFERENCE = os.path.join("docs", "reference", "outputs.md")
DECLARATIONS = (("bound", BoundOptions), ("batch", BatchOptions), ("train", TrainOptions))
# madp audit's options: a config's audit section gives their defaults, its flags override them.
AUDIT_DECLARATION = ("audit", AuditOptions)
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
REGENERATE = "python -m madp.jobs.reference"


def options_reference() -> str:
    """The options reference as Markdown."""
    lines = [
        "# Options",
        "",
        f"Generated from the options' declarations by `{REGENERATE}`: edit those, not this page.",
        "",
        "A `madp run` section's key is an option's name with underscores (`max_contributions: 3` is",
        "`--max-contributions 3`, `true` a switch). The bound and batch sections also take `runner` and",
        "`runner_options`: `runner: pyspark` runs the stage on Apache Spark, its Spark options in `runner_options`",
        '(`[--spark-master, "spark://host:7077", --partitions, "64"]`); the train section takes `baseline`;',
        "a generate section takes `madp generate`'s options",
        "and `holdout`; the audit section gives `madp audit` its defaults. The commands after `madp audit` are no",
        "`madp run` sections: their options have no keys.",
    ]
    for command, declaration in (*DECLARATIONS, AUDIT_DECLARATION):
        lines += ["", f"## madp {command}", "", "| option | `madp run` key | default | help |", "|---|---|---|---|"]
        lines += [_row(command, each) for each in declared(declaration)]
    for command, options in COMMAND_DECLARATIONS:
        lines += ["", f"## madp {command}", "", "| option | default | help |", "|---|---|---|"]
        lines += [f"| {_flags(each)} | {_default(each)} | {_help(each)} |" for each in declared(options)]
    return "\n".join(lines) + "\n"


def _row(command: str, each: Declared) -> str:
    section = CALIBRATE if each.option.section == CALIBRATE else command
    return f"| {_flags(each)} | `{section}.{each.name}` | {_default(each)} | {_help(each)} |"


def _help(each: Declared) -> str:
    return _cell(each.option.help or "")


def _flags(each: Declared) -> str:
    return ", ".join(f"`{flag}`" for flag in each.flags)


def _default(each: Declared) -> str:
    if each.default is dataclasses.MISSING:
        return "required"
    if each.switch or each.default in (None, ()):
        return ""
    return f"`{each.default or repr(each.default)}`"  # '' shown as such


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


# --- the outputs ---------------------------------------------------------------------------------


class Output(NamedTuple):
    """A file (or, ending in "/", a folder) a stage writes below its output: `path` as `fnmatch` matches
    it, whether a user may publish it (the README's "What may be published, and what is internal"), what it
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
        "parameters); **internal**: never publish it (README: Privacy guarantee, what may be published). A",
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


if __name__ == "__main__":
    for path, page in ((REFERENCE, options_reference()), (OUTPUTS_REFERENCE, outputs_reference())):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(page)
