"""The audit section of a `madp run` config: the audit's options and where it writes. `madp run` plans
the audit stage from them; `madp.jobs.audit` runs it."""

from __future__ import annotations

import dataclasses
import os

from madp.core import storage
from madp.core.errors import InputError, positive

DEFAULT_DIRECTORY = "audit"


@dataclasses.dataclass(frozen=True)
class AuditOptions:
    canaries: int = 1000
    confidence: float = 0.95
    canary_norm: float = 10.0  # canary features' norm, in units of the real records' median feature norm
    shared: float = 0.5  # fraction of canaries that share one record with another canary
    output: str | None = None  # default run_dir/audit
    non_private: bool = False  # train the audit model without privacy (what the audit sees with none)
    testing_noise_scale: float = 1.0
    seed: int | None = None  # None: fresh secret inclusion and content

    def __post_init__(self) -> None:
        checks = [
            (self.canaries >= 2, "--canaries must be at least 2"),
            (0 < self.confidence < 1, "--confidence must be in (0, 1)"),
            (positive(self.canary_norm), "--canary-norm must be positive and finite"),
            (0 <= self.shared <= 1, "--shared must be in [0, 1]"),
            (positive(self.testing_noise_scale), "--testing-only-noise-scale must be positive and finite"),
            (
                not (self.non_private and self.testing_noise_scale != 1.0),
                "--non-private trains without noise: drop --testing-only-noise-scale",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise InputError(message)


OPTION_KEYS = tuple(f.name for f in dataclasses.fields(AuditOptions))


def audit_options(config: dict, flags: dict) -> AuditOptions:
    """The config's audit section, overridden by command-line flags (those not None)."""
    if not all(config.get(name) for name in ("bound", "batch", "calibrate", "train")):
        raise InputError(
            "config: an audit trains the config's model, so it needs bound, batch, calibrate and train sections"
        )
    if str(config["train"].get("model", "")) in ("text-classifier", "text-lm", "causal-lm"):
        raise InputError(
            f"config train.model {config['train']['model']}: madp audit scores canaries with a numeric model "
            f"(logreg, mlp, module:function); text models cannot be audited yet"
        )
    inputs = config["train"].get("inputs") or ()  # a list, or `a,b` as its flag takes it
    if len(inputs if isinstance(inputs, list) else str(inputs).split(",")) > 1:
        raise InputError(
            f"config train.inputs {inputs}: the audit plants its canaries in one features vector; "
            f"a model of several inputs cannot be audited"
        )
    section = config.get("audit") or {}
    if not isinstance(section, dict):
        raise InputError("config audit: a mapping of options (canaries, confidence, ...)")
    unknown = sorted(set(section) - set(OPTION_KEYS))
    if unknown:
        raise InputError(f"config audit: unknown key(s) {', '.join(unknown)} (known: {', '.join(OPTION_KEYS)})")
    merged = {**section, **{k: v for k, v in flags.items() if v is not None}}
    kinds = {f.name: f.type for f in dataclasses.fields(AuditOptions)}
    for key, value in merged.items():
        types: dict[str, type | tuple[type, ...]] = {"int": int, "float": (int, float), "bool": bool}
        expected = types.get(kinds[key].split(" |")[0])
        if (
            value is not None
            and expected
            and (not isinstance(value, expected) or (isinstance(value, bool) and expected is not bool))
        ):
            raise InputError(f"config audit.{key}: expected {kinds[key].split(' |')[0]}, got {value!r}")
    return AuditOptions(**merged)


def audit_directory(config: dict, options: AuditOptions) -> str:
    """Where the audit writes: run_dir/audit, or --output anywhere outside run_dir (never over the job)."""
    run_dir = config["run_dir"]
    default = storage.join(run_dir, DEFAULT_DIRECTORY)
    if options.output is None:
        return default
    output, job = _normalized(options.output), _normalized(run_dir)
    if output != _normalized(default) and (
        output == job or output.startswith(job + os.sep) or job.startswith(output + os.sep)
    ):
        raise InputError(
            f"audit output {options.output}: inside or around run_dir {run_dir}, where the job's "
            f"outputs are; use {default} or a directory outside it"
        )
    return options.output


def _normalized(path: str) -> str:
    return path.rstrip("/") if "://" in path else os.path.normpath(os.path.abspath(path))
