"""`madp run CONFIG.yaml`, running: the planned stages (`madp.jobs.run_plan`) one after the other, each
resumable. A stage whose outputs exist and whose parameters and input files (names, sizes,
modification times) are those of its last successful run is skipped; `--force` re-runs all.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from typing import Any

import madp
from madp.commands.registry import Parser
from madp.commands.training import calibrate_batches
from madp.core import storage
from madp.core.errors import CheckFailed
from madp.jobs.run_plan import Stage, load_config, plan_stages
from madp.tools.report import QUALITY_METRICS, shows_sampling

log = logging.getLogger("madp.run")
MANIFESTS = ".madp"


def fingerprint(stage: Stage) -> str:
    """Digest of the stage's command and of the names, sizes and modification times of its input files."""
    digest = hashlib.sha256(json.dumps([madp.__version__, stage.command]).encode())  # an upgrade re-runs
    for path in stage.inputs:
        for name, size, modified in storage.stamps(path):
            digest.update(f"{name}\0{size}\0{modified}\n".encode())
    return digest.hexdigest()


def _manifest(run_dir: str, stage: Stage) -> str:
    return storage.join(run_dir, MANIFESTS, f"{stage.name}.json")


def up_to_date(run_dir: str, stage: Stage) -> bool:
    manifest = _manifest(run_dir, stage)
    if storage.kind(manifest) != "file" or storage.kind(stage.output) == "missing":
        return False
    try:
        recorded = json.loads(storage.read_text(manifest))
    except ValueError:
        log.warning("%s is damaged (truncated?): stage %s runs again", manifest, stage.name)
        return False
    return isinstance(recorded, dict) and recorded.get("fingerprint") == fingerprint(stage)


def run(config_path: str, overrides: list[str], parser: Parser, force: bool = False) -> dict:
    """The job of a config; `parser` (every madp command) plans and runs its stages."""
    config = load_config(config_path, overrides)
    stages = plan_stages(config, parser, (config_path, overrides))
    run_dir = config["run_dir"]
    with storage.exclusive(run_dir, f"run {config_path}"):
        return run_stages(run_dir, config_path, stages, parser, force)


def run_stages(run_dir: str, config_path: str, stages: list[Stage], parser: Parser, force: bool) -> dict:
    summary: dict[str, Any] = {"config": config_path, "run_dir": run_dir, "stages": []}
    started = time.perf_counter()
    for number, stage in enumerate(stages, 1):
        if not force and up_to_date(run_dir, stage):
            log.info(
                "stage %d/%d %s: outputs up to date (same parameters and inputs), skipped; --force re-runs",
                number,
                len(stages),
                stage.name,
            )
            summary["stages"].append({"stage": stage.name, "status": "skipped"})
            continue
        log.info("stage %d/%d %s: madp %s", number, len(stages), stage.name, " ".join(stage.command))
        if stage.name in ("generate", "train", "baseline"):
            storage.clear_directory(stage.output)  # these write fresh outputs; bound and batch clear their own
        stage_started = time.perf_counter()
        manifest = _manifest(run_dir, stage)
        storage.remove_file(manifest)
        args, extra = parser.parse_known_args(stage.command)
        result = calibrate_batches(args) if stage.name == "calibrate" else parser.run(args, extra)
        if result.get("ok") is False:
            raise CheckFailed(
                f"stage {stage.name}: the independent verifier failed: {json.dumps(result, default=str)[:2000]}", result
            )
        storage.write_text(
            manifest,
            json.dumps({"stage": stage.name, "command": stage.command, "fingerprint": fingerprint(stage)}, indent=2),
        )
        summary["stages"].append(
            {"stage": stage.name, "status": "ran", "wall_time_s": round(time.perf_counter() - stage_started, 3)}
        )
    summary["wall_time_s"] = round(time.perf_counter() - started, 3)
    summary["results"] = _results(run_dir)
    return summary


def _results(run_dir: str) -> dict:
    """The figures a user looks at first, from the run's reports."""

    def load(name: str) -> dict | None:
        path = storage.join(run_dir, name)
        return json.loads(storage.read_text(path)) if storage.kind(path) == "file" else None

    bound, batches = load("bound/report.json"), load("batches/report.json")
    privacy = load("train/privacy.json") or load("calibration.json")
    train, baseline = load("train/metrics.json"), load("baseline/metrics.json")
    results = {}
    if bound:
        results["bound"] = {"input_records": bound["input_records"], "selected_records": bound["selected_records"]}
    if batches:
        results["batch"] = {"sampling_probability": batches.get("sampling_probability")}
        if shows_sampling({"batches": batches, "privacy": privacy}):  # else the realized sizes stay internal
            results["batch"]["mean_batch_size"] = batches["batch_sizes"]["mean"]
    if privacy and privacy.get("mechanism") != "none":
        results["privacy"] = {
            key: privacy.get(key)
            for key in (
                "mechanism",
                "noise_multiplier",
                "epsilon",
                "delta",
                "contribution_bound",
                "sampling",
                "noise",
                "private",
            )
            if key in privacy
        }
    finals = {name: (m or {}).get("final") or {} for name, m in (("train", train), ("baseline", baseline))}
    for name, final in finals.items():
        if final:
            results[name] = {k: v for k, v in final.items() if k != "per_class"}  # per class: metrics.json
    gap = {
        m: finals["train"][m] / finals["baseline"][m]
        for m in QUALITY_METRICS
        if finals["train"].get(m) and finals["baseline"].get(m)
    }
    if gap:
        results["private_over_non_private"] = {m: round(v, 4) for m, v in gap.items()}
    audit = load("audit/audit.json")
    if audit and not audit.get("audit_model_private"):
        results["audit"] = {"internal": "the audit model is not private: see audit/audit.json"}
    elif audit:
        results["audit"] = {
            key: audit[key]
            for key in (
                "canaries",
                "epsilon_lower_bound",
                "confidence",
                "largest_measurable_epsilon",
                "claimed_epsilon",
                "verdict",
            )
        }
    return results
