"""`madp run CONFIG.yaml`, running: the planned stages (`madp.jobs.run_plan`) one after the other, each
resumable. A stage whose outputs exist and whose parameters and input files (their contents, digested
before the stage and checked after it) are those of its last successful run is skipped; `--force`
re-runs all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import madp
from madp.commands.registry import CommandResult
from madp.core import output_lock, storage
from madp.core.batch_files import TRAININGS_FILE, BatchReport, read_batch_report
from madp.core.errors import CheckFailed, InputError
from madp.core.reports import AuditReport, BoundReport
from madp.core.selection import REPORT_FILE, read_bound_report
from madp.jobs.run_check import check_columns, check_feasible
from madp.jobs.run_config import RunConfig
from madp.jobs.run_plan import Source, Stage, stages_of
from madp.jobs.run_steps import AuditJob
from madp.tools.report import QUALITY_METRICS, published_with_audit, shows_sampling
from madp.training.ledger import refuse_stranding, stranded_checkpoints
from madp.training.outputs import evaluations_of, replaced_directory, settle_replaced, settled_text
from madp.training.plan import Guarantee, PrivacyPlan, stated_plan

log = logging.getLogger("madp.run")
MANIFESTS = ".madp"
INTERNAL_RESULTS = "internal-results.json"  # beside baseline/ and batches/: never published
AUDIT = "audit/audit.json"  # `madp audit`'s, where the run's audit stage wrote it
TRAININGS = ("train", "baseline")  # the stages that run `madp train`


# The figures of the privacy plan and of the audit that the results show
PRIVACY_FIGURES = ("mechanism", "noise_multiplier", "epsilon", "delta", "contribution_bound", "sampling")
AUDIT_FIGURES = (
    "canaries",
    "epsilon_lower_bound",
    "confidence",
    "largest_measurable_epsilon",
    "claimed_epsilon",
    "verdict",
)


def _figures(report: object, names: tuple[str, ...]) -> dict[str, Any]:
    return {name: getattr(report, name) for name in names}


@dataclasses.dataclass(frozen=True)
class RunResults:
    """The figures a user looks at first, from the run's reports (the summary's `results`): only what the
    guarantee covers. `sampling_shown`: the batches' realized mean size may be published (`shows_sampling`);
    `audit_with_the_model`: the guarantee of the model and the audit model published together."""

    bound: BoundReport | None
    batches: BatchReport | None
    sampling_shown: bool
    plan: PrivacyPlan | None
    train: Mapping[str, Any] | None  # the published last evaluation, per-class figures left out
    audit: AuditReport | None
    audit_with_the_model: Guarantee | None

    def to_json(self) -> dict[str, Any]:
        results: dict[str, Any] = {}
        if self.bound is not None:
            results["bound"] = {
                "input_records": self.bound.input_records,
                "selected_records": self.bound.selected_records,
            }
        if self.batches is not None:
            results["batch"] = {"sampling_probability": self.batches.sampling_probability}
            if self.sampling_shown:
                results["batch"]["mean_batch_size"] = self.batches.batch_sizes.mean
        plan = self.plan
        if plan is not None:
            results["privacy"] = {
                **_figures(plan, PRIVACY_FIGURES),
                **({} if plan.noise is None else {"noise": plan.noise, "private": plan.private}),  # a trained model's
            }
        if self.train is not None:
            results["train"] = dict(self.train)
        audit = self.audit
        if audit is not None and not audit.audit_model_private:
            results["audit"] = {"internal": "the audit model is not private: see audit/audit.json"}
        elif audit is not None:
            results["audit"] = _figures(audit, AUDIT_FIGURES)
            together = self.audit_with_the_model
            if together is not None:  # its figures beside the model release a second training of the records
                results["audit"]["published_with_the_model"] = {
                    "epsilon": together.epsilon,
                    "delta": together.delta,
                    "composition": "the model's and the audit model's guarantees summed (basic composition): "
                    "what publishing this summary or the audit's figures beside the model costs",
                }
        return results


@dataclasses.dataclass(frozen=True)
class InternalResults:
    """RUN_DIR/internal-results.json: what the operator compares but nobody may publish, each figure left out
    where the run has none (the wall times depend on the realized sampling and the records' content)."""

    train: Mapping[str, Any] | None  # the private model's last evaluation, on data not declared public
    baseline: Mapping[str, Any] | None  # the non-private model's last evaluation
    private_over_non_private: Mapping[str, float] | None  # the private model's quality metrics over the baseline's
    wall_time_s: Mapping[str, float]  # seconds each stage that ran took, and the total

    def to_json(self) -> dict[str, Any]:
        figures = {
            "train": self.train,
            "baseline": self.baseline,
            "private_over_non_private": self.private_over_non_private,
        }
        return {
            **{name: dict(value) for name, value in figures.items() if value is not None},
            "wall_time_s": dict(self.wall_time_s),
        }


@dataclasses.dataclass(frozen=True)
class StageStatus:
    """What a run did with a stage: `ran`, or `skipped` (up to date)."""

    stage: str
    status: str

    def to_json(self) -> dict[str, str]:
        return {"stage": self.stage, "status": self.status}


@dataclasses.dataclass(frozen=True)
class RunSummary:
    """What `madp run` prints: its config and run directory, each stage's status, the results, and where the
    internal ones are."""

    config: str
    run_dir: str
    stages: tuple[StageStatus, ...]
    results: RunResults
    internal: str  # internal-results.json, and that it may not be published

    def to_json(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "run_dir": self.run_dir,
            "stages": [stage.to_json() for stage in self.stages],
            "results": self.results.to_json(),
            "internal": self.internal,
        }


def fingerprint(stage: Stage) -> str:
    """Digest of the stage's parameters (its command, less what says only how it reaches its outputs: a
    training finished by --resume is the one a plain re-run finds) and of the content of every file it reads.
    Content, not names, sizes and modification times: an edit that keeps those (`cp -p`, `rsync -t`, a
    coarse-mtime file system) must re-run the stage, since the claim is made for the data it read."""
    digest = hashlib.sha256(json.dumps([madp.__version__, stage.parameters]).encode())  # an upgrade re-runs
    for path in stage.inputs:
        # The trainings ledger (beside the selection; in a batch output, of an earlier madp) is not data.
        digest.update(f"{path}\0{storage.content_digest(path, ignore=(TRAININGS_FILE,))}\n".encode())
    return digest.hexdigest()


def _writing(stage: Stage):
    """Hold the stage's output directory (OUTPUT/.madp.lock) while the stage writes it, as a standalone
    command would: a `madp bound` already writing run_dir/bound, or a `madp train` run_dir/train, makes
    the run stop instead of mixing in. A verifier writes nothing: it holds a reader's mark on the folder it
    checks. The audit takes its own lock; files (calibration.json, the pages) are written whole at the end."""
    if stage.name == "audit" or stage.output.endswith((".json", ".html")):
        return contextlib.nullcontext()
    if stage.name.startswith("verify-"):
        return output_lock.reading(stage.output, f"madp run stage {stage.name}")
    return output_lock.exclusive(stage.output, f"run stage {stage.name}")


def _manifest(run_dir: str, stage: Stage) -> str:
    return storage.join(run_dir, MANIFESTS, f"{stage.name}.json")


def _pending(run_dir: str, stage: Stage) -> str:
    """The manifest a running stage set aside, with the content digest of the output it describes."""
    return storage.join(run_dir, MANIFESTS, f"{stage.name}.pending.json")


@dataclasses.dataclass(frozen=True)
class StageManifest:
    """RUN_DIR/.madp/STAGE.json: a stage's last successful run, its command and its fingerprint."""

    stage: str
    command: list[str]
    fingerprint: str

    def to_json(self) -> dict[str, Any]:
        return {"stage": self.stage, "command": self.command, "fingerprint": self.fingerprint}

    @classmethod
    def from_json(cls, data: Any) -> StageManifest | None:
        """The manifest a manifest file's JSON holds (None where it records no fingerprint: the stage runs
        again)."""
        if not isinstance(data, dict) or data.get("fingerprint") is None:
            return None
        return cls(data.get("stage", ""), data.get("command", []), data["fingerprint"])


@dataclasses.dataclass(frozen=True)
class PendingManifest:
    """RUN_DIR/.madp/STAGE.pending.json: a running stage's manifest set aside, with the content digest of the
    output it describes (`_take_manifest_back`)."""

    manifest: str  # the manifest's text
    output: str  # `storage.content_digest` of the stage's output

    def to_json(self) -> dict[str, str]:
        return {"manifest": self.manifest, "output": self.output}

    @classmethod
    def from_json(cls, data: Any) -> PendingManifest:
        """Raises KeyError or TypeError where `data` is no pending manifest."""
        return cls(data["manifest"], data["output"])


def _set_manifest_aside(run_dir: str, stage: Stage) -> None:
    """Before the stage runs, its manifest goes, so that a stage stopped half-way is never taken for done. It
    is kept as pending, with its output's content digest, for `_take_manifest_back`."""
    manifest = _manifest(run_dir, stage)
    if storage.kind(manifest) != "file":
        return
    pending = PendingManifest(storage.read_text(manifest), storage.content_digest(stage.output))
    storage.write_text(_pending(run_dir, stage), json.dumps(pending.to_json()))
    storage.remove_file(manifest)


def _take_manifest_back(run_dir: str, stage: Stage) -> None:
    """The manifest set aside for a run of the stage that stopped (an error, Ctrl-C, or killed with no clean-up:
    taken back by the next run's `_up_to_date`), back where the output is still byte for byte the one it
    describes: a stage refused by its own checks (the ledger, a checkpoint to resume, a file of the user's), or
    a training that gave the finished one back, leaves those outputs up to date for what they were made from."""
    pending = _pending(run_dir, stage)
    if storage.kind(pending) != "file":
        return
    try:
        kept = PendingManifest.from_json(json.loads(storage.read_text(pending)))
    except (ValueError, TypeError, KeyError):
        log.warning("%s is damaged (truncated?): stage %s is not taken for done", pending, stage.name)
        return
    if storage.content_digest(stage.output) == kept.output:
        storage.write_text(_manifest(run_dir, stage), kept.manifest)
        storage.remove_file(pending)


def _run_stage(run_dir: str, stage: Stage, current: str) -> CommandResult:
    """Run a stage whose output's lock is held. Nothing of its output is deleted for it: the stage itself
    replaces its earlier outputs after its own checks (`madp train --replace`, generate's shards, bound's and
    batch's outputs). Its manifest is set aside first, and back if it stops having changed nothing of it; once
    the stage has run (and its verifier, if it is one, passed), its manifest for the `current` fingerprint is
    written at once: a stop while the inputs are digested again after it (minutes over large inputs) leaves
    it done, not to be run again (a training: a second one, composed with it)."""
    _set_manifest_aside(run_dir, stage)
    try:
        result = CommandResult.from_json(stage.step.run())
    except BaseException:
        _take_manifest_back(run_dir, stage)
        raise
    if result.ok:
        manifest = StageManifest(stage.name, stage.command, current)
        storage.write_text(_manifest(run_dir, stage), json.dumps(manifest.to_json(), indent=2))
        storage.remove_file(_pending(run_dir, stage))
    return result


def _settle_replaced_training(stage: Stage) -> None:
    """A training stage's output where a `madp train --replace` was killed with no clean-up (SIGKILL, a power
    cut) still holds the training it replaced set aside: settled first (`settle_replaced`, as `madp train` does
    at its start, under the output's lock), so that the output is that finished training again, or the new one
    kept to resume, before the stage is checked for being up to date."""
    if storage.kind(replaced_directory(stage.output)) == "missing":
        return
    with _writing(stage):
        said = settled_text(stage.output, settle_replaced(stage.output))
    if said is not None:
        log.warning("stage %s: %s", stage.name, said)


def _up_to_date(run_dir: str, stage: Stage, current: str) -> bool:
    """Whether the stage's outputs exist and its last successful run had the `current` fingerprint (its manifest,
    or the one a stopped run of it set aside, where its output is still the one that describes)."""
    manifest = _manifest(run_dir, stage)
    if storage.kind(manifest) != "file":
        _take_manifest_back(run_dir, stage)
    if storage.kind(manifest) != "file" or storage.kind(stage.output) == "missing":
        return False
    try:
        recorded = json.loads(storage.read_text(manifest))
    except ValueError:
        log.warning("%s is damaged (truncated?): stage %s runs again", manifest, stage.name)
        return False
    last = StageManifest.from_json(recorded)
    return last is not None and last.fingerprint == current


def _refuse_remaking_trained_batches(run_dir: str, stages: list[Stage], force: bool) -> None:
    """The checkpoint of an interrupted training on the batch stage's output (a training stage's, or another
    the trainings ledger holds: `stranded_checkpoints`) resumes only on the batches it trained on: a run that
    would re-make them (a stage up to the batch stage that is not up to date, or all of them under --force)
    would leave the checkpoint for ever refused. Refused here, before any stage runs, naming the stage and the
    ways out (`madp batch` refuses the same on its own, but only once the stages before it have run)."""
    batches = next((stage.output for stage in stages if stage.name == "batch"), None)
    if batches is None:
        return
    held = stranded_checkpoints(batches, [stage.output for stage in stages if stage.name in TRAININGS])
    for stage in stages if held else []:
        remakes = not stage.name.startswith("verify-")  # a verifier changes nothing the training read
        if remakes and (force or not _up_to_date(run_dir, stage, fingerprint(stage))):
            why = "--force re-runs every stage" if force else "its options, inputs or outputs changed since it ran"
            refuse_stranding(
                held,
                f"stage {stage.name} would run again ({why})",
                "Undo the change (or leave out --force) and resume it (train.resume: true)",
            )
        if stage.name == "batch":
            return


def run(config_path: str, overrides: list[str], audit: AuditJob, force: bool = False) -> RunSummary:
    """The job of a config; `audit` runs its audit stage (`madp audit CONFIG`, `madp.jobs.audit.run_audit`)."""
    config = RunConfig.read(config_path, overrides)
    stages = stages_of(config, Source(config_path, overrides, audit))
    with output_lock.exclusive(config.run_dir, f"run {config_path}"):
        return run_stages(config.run_dir, config_path, stages, force, lambda: check_feasible(stages))


def run_stages(
    run_dir: str,
    config_path: str,
    stages: list[Stage],
    force: bool,
    before_bounding: Callable[[], None] | None = None,
) -> RunSummary:
    """Run the stages that are not up to date; a run that would re-make the batches an interrupted training's
    checkpoint trained on is refused before any stage runs, the columns the training reads are checked before
    the first stage after generate (which may make the input) that runs, and `before_bounding` (the plan's
    feasibility check) once, before the first bound or batch stage that runs."""
    _refuse_remaking_trained_batches(run_dir, stages, force)
    ran: list[StageStatus] = []
    # Wall times depend on the realized (secret) sampling and the records' content: internal only
    timings: dict[str, float] = {}
    started = time.perf_counter()
    columns_checked = False
    for number, stage in enumerate(stages, 1):
        current = fingerprint(stage)  # taken before the stage reads anything, checked again after it
        if stage.name in TRAININGS:
            _settle_replaced_training(stage)
        if not force and _up_to_date(run_dir, stage, current):
            log.info(
                "stage %d/%d %s: outputs up to date (same parameters and inputs), skipped; --force re-runs",
                number,
                len(stages),
                stage.name,
            )
            ran.append(StageStatus(stage.name, "skipped"))
            continue
        if stage.name != "generate" and not columns_checked:
            check_columns(stages)
            columns_checked = True
        if stage.name in ("bound", "batch") and before_bounding is not None:
            before_bounding()
            before_bounding = None
        log.info("stage %d/%d %s: madp %s", number, len(stages), stage.name, " ".join(stage.command))
        stage_started = time.perf_counter()
        with _writing(stage):
            result = _run_stage(run_dir, stage, current)
        if not result.ok:
            printed = result.to_json()
            raise CheckFailed(
                f"stage {stage.name}: the independent verifier failed: {json.dumps(printed, default=str)[:2000]}",
                printed,
            )
        if fingerprint(stage) != current:
            storage.remove_file(_manifest(run_dir, stage))
            raise InputError(
                f"stage {stage.name}: its inputs ({', '.join(stage.inputs)}) changed while it ran, so its outputs "
                f"describe neither version; nothing is recorded as done: run again once they stay put"
            )
        ran.append(StageStatus(stage.name, "ran"))
        timings[stage.name] = round(time.perf_counter() - stage_started, 3)
    timings["total"] = round(time.perf_counter() - started, 3)
    path = storage.join(run_dir, INTERNAL_RESULTS)
    storage.write_text(path, json.dumps(_internal_results(run_dir, timings).to_json(), indent=2))
    internal = f"{path}: figures the guarantee does not cover (do not publish)"
    return RunSummary(config_path, run_dir, tuple(ran), _results(run_dir), internal)


def _load(run_dir: str, name: str) -> dict | None:
    path = storage.join(run_dir, name)
    return json.loads(storage.read_text(path)) if storage.kind(path) == "file" else None


def _has_report(run_dir: str, stage: str) -> bool:
    return storage.kind(storage.join(run_dir, stage, REPORT_FILE)) == "file"


def _final(output: str, internal: bool) -> Mapping[str, Any]:
    """A training's last evaluation ({} where it has none the reader may see)."""
    evaluations = evaluations_of(output, internal)
    return (evaluations.final if evaluations is not None else None) or {}


def _internal_results(run_dir: str, wall_time_s: Mapping[str, float]) -> InternalResults:
    """What the operator compares but nobody may publish: the non-private baseline saw the records
    without noise, so its metrics (and their ratio to the private model's) are not covered by the
    guarantee."""
    train, baseline = (_final(storage.join(run_dir, name), internal=True) for name in ("train", "baseline"))
    internal_train = None
    if train and not evaluations_of(storage.join(run_dir, "train"), internal=False):  # --eval-data not public
        internal_train = _without_per_class(train)
    if not baseline:
        return InternalResults(internal_train, None, None, wall_time_s)
    gap = {m: round(train[m] / baseline[m], 4) for m in QUALITY_METRICS if train.get(m) and baseline.get(m)}
    return InternalResults(internal_train, _without_per_class(baseline), gap or None, wall_time_s)


def _without_per_class(evaluation: Mapping[str, Any]) -> dict[str, Any]:
    """An evaluation's figures but its per-class ones (those are in metrics.json)."""
    return {k: v for k, v in evaluation.items() if k != "per_class"}


def _results(run_dir: str) -> RunResults:
    """The figures a user looks at first, from the run's reports: only what the guarantee covers."""
    bound = read_bound_report(storage.join(run_dir, "bound")) if _has_report(run_dir, "bound") else None
    batches = read_batch_report(storage.join(run_dir, "batches")) if _has_report(run_dir, "batches") else None
    privacy = _load(run_dir, "train/privacy.json") or _load(run_dir, "calibration.json")
    train = evaluations_of(storage.join(run_dir, "train"), internal=False)  # on public eval data only
    plan = stated_plan(privacy) if privacy else None
    final = None if train is None else train.final
    stated = _load(run_dir, AUDIT)
    audit = None if stated is None else AuditReport.from_json(stated, storage.join(run_dir, AUDIT))
    return RunResults(
        bound=bound,
        batches=batches,
        sampling_shown=batches is not None and shows_sampling(plan, batches),  # else the realized sizes stay internal
        plan=plan,
        train=_without_per_class(final) if final else None,  # per class: metrics.json
        audit=audit,
        audit_with_the_model=published_with_audit(plan, audit) if audit is not None else None,
    )
