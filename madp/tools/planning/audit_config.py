"""The audit section of a `madp run` config: the audit's options, declared once for the section's keys and
`madp audit`'s flags, and where it writes. `madp run` plans the audit stage from them; `madp.jobs.audit`
runs it."""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Mapping
from typing import Any

from madp.core import storage
from madp.core.errors import InputError, positive
from madp.core.options import declared, option, seed_argument, value_type

DEFAULT_DIRECTORY = "audit"


@dataclasses.dataclass(frozen=True)
class AuditOptions:
    """The options of `madp audit` (each field its `--flag`), and the keys of a config's audit section, which
    gives the defaults of the flags left out."""

    canaries: int = option(1000, help="m: canary users (default 1000)")
    confidence: float = option(0.95, help="of the lower bound (default 0.95)")
    # canary features' norm, in units of the real records' median feature norm
    canary_norm: float = option(10.0, help="canary feature norm, in real records' median norms (default 10)")
    # fraction of canaries that share one record with another canary
    shared: float = option(0.5, help="fraction of canaries sharing a record with another (default 0.5)")
    output: str | None = option(  # None: run_dir/audit
        None, help="directory of the audit's data, model and audit.json (default RUN_DIR/audit)"
    )
    non_private: bool = option(  # train the audit model without privacy (what the audit sees with none)
        False, help="train the audit model without privacy: what the audit can see when nothing protects"
    )
    testing_noise_scale: float = option(
        1.0,
        flag="--testing-only-noise-scale",
        metavar="TESTING_ONLY_NOISE_SCALE",
        help="TESTING ONLY: scale the audit model's noise while keeping the claim; the audit must fail",
    )
    seed: int | None = option(  # None: fresh secret inclusion and content
        None, parse=seed_argument, help="TESTING ONLY: reproduce canaries and inclusion (default: secret)"
    )

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


OPTION_KEYS = tuple(each.name for each in declared(AuditOptions))
# The types a section's value must be of, by the option's type (a float option takes an integer too)
SECTION_TYPES: dict[type, type | tuple[type, ...]] = {int: int, float: (int, float), bool: bool}


def audit_options(section: Mapping[str, Any], given: Mapping[str, Any]) -> AuditOptions:
    """The config's audit section, overridden by the options `given` on the command line (those not None)."""
    unknown = sorted(set(section) - set(OPTION_KEYS))
    if unknown:
        raise InputError(f"config audit: unknown key(s) {', '.join(unknown)} (known: {', '.join(OPTION_KEYS)})")
    merged = {**section, **{name: value for name, value in given.items() if value is not None}}
    hints = typing.get_type_hints(AuditOptions)
    for name, value in merged.items():
        kind = value_type(hints[name])
        expected = SECTION_TYPES.get(kind)
        if (
            value is not None
            and expected
            and (not isinstance(value, expected) or (isinstance(value, bool) and expected is not bool))
        ):
            raise InputError(f"config audit.{name}: expected {kind.__name__}, got {value!r}")
    return AuditOptions(**merged)


def audit_directory(run_dir: str, options: AuditOptions) -> str:
    """Where the audit writes: run_dir/audit, or --output anywhere outside run_dir (never over the job)."""
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
