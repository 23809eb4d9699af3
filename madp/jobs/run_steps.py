"""`madp run CONFIG.yaml`, its steps: what each planned stage runs (`madp.jobs.run_plan.Stage.step`), with
its options built from the config, and the files it reads besides its inputs. A step's `run` calls the
function its `madp` command calls (`madp.stages`, the independent verifiers, the report page) and returns
the command's result."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from madp.commands.data import GenerateOptions, generate
from madp.core.records import Columns
from madp.core.selection import BoundOptions
from madp.engines.batching import BatchOptions
from madp.training.options import TrainOptions

Result = dict[str, Any]  # as the stage's command prints it
AuditJob = Callable[[str, list[str]], Result]  # (a config, its --set overrides) -> the audit of its model


def _given(*paths: str | None) -> tuple[str, ...]:
    return tuple(path for path in paths if path is not None)


@dataclasses.dataclass(frozen=True)
class Generate:
    """`madp generate`: synthetic records at `output`."""

    output: str
    options: GenerateOptions

    @property
    def reads(self) -> tuple[str, ...]:
        return ()

    def run(self) -> Result:
        return generate(self.output, self.options)


@dataclasses.dataclass(frozen=True)
class Bound:
    """`madp bound`: the selection of `input`'s records at `output`, on `runner` (with its runner options)."""

    input: str
    output: str
    options: BoundOptions
    runner: str
    runner_options: tuple[str, ...]

    @property
    def reads(self) -> tuple[str, ...]:
        return _given(self.input, self.options.capacities)

    def run(self) -> Result:
        from madp.stages.bounding import run_bound

        return run_bound(self.input, self.output, self.options, self.runner, self.runner_options).to_json()


@dataclasses.dataclass(frozen=True)
class VerifyBound:
    """`madp verify-bound`: the independent check of the selection at `output` against `input`."""

    input: str
    output: str
    max_contributions: int
    capacities: str | None
    columns: Columns

    @property
    def reads(self) -> tuple[str, ...]:
        return ()

    def run(self) -> Result:
        from madp.stages.bounding import run_verify_bound

        return run_verify_bound(self.input, self.output, self.max_contributions, self.capacities, self.columns)


@dataclasses.dataclass(frozen=True)
class Batch:
    """`madp batch`: the training batches of the selection `selected` of `data`'s records at `output`."""

    selected: str
    data: str
    output: str
    options: BatchOptions
    runner: str
    runner_options: tuple[str, ...]

    @property
    def reads(self) -> tuple[str, ...]:
        return (self.selected, self.data)

    def run(self) -> Result:
        from madp.stages.batching import run_batch

        return run_batch(
            self.selected, self.data, self.output, self.options, self.runner, self.runner_options
        ).to_json()


@dataclasses.dataclass(frozen=True)
class VerifyBatches:
    """`madp verify-batches`: the independent check of the batches at `output` against the records `data`
    and the selection `selected`, whose users contribute at most `max_contributions` copies."""

    output: str
    data: str
    min_sep: int
    max_batch_size: int | None
    selected: str
    max_contributions: int
    columns: Columns

    @property
    def reads(self) -> tuple[str, ...]:
        return ()

    def run(self) -> Result:
        from madp.stages.batching import run_verify_batches

        return run_verify_batches(
            self.output,
            self.data,
            self.columns,
            min_sep=self.min_sep,
            max_participations=None,
            max_batch_size=self.max_batch_size,
            selected=self.selected,
            max_contributions=self.max_contributions,
            capacities=None,
        )


@dataclasses.dataclass(frozen=True)
class Calibrate:
    """The privacy plan of training on `batches` with the privacy options, written to `output`
    (calibration.json); the result is its content."""

    batches: str
    output: str
    options: TrainOptions

    @property
    def reads(self) -> tuple[str, ...]:
        return _training_reads(self.batches, self.options)

    def run(self) -> Result:
        from madp.stages.calibrating import calibration_json, run_calibrate

        return calibration_json(run_calibrate(self.batches, self.output, self.options))


@dataclasses.dataclass(frozen=True)
class Train:
    """`madp train`: a model trained on `batches` at `output` (a private one, or the non-private baseline)."""

    batches: str
    output: str
    options: TrainOptions

    @property
    def reads(self) -> tuple[str, ...]:
        return _training_reads(self.batches, self.options)

    def run(self) -> Result:
        from madp.stages.training import run_train

        return run_train(self.batches, self.output, self.options).to_json()


def _training_reads(batches: str, options: TrainOptions) -> tuple[str, ...]:
    return _given(batches, *options.paths_beside_batches)


@dataclasses.dataclass(frozen=True)
class Audit:
    """`madp audit CONFIG`: the audit job of the run's config, with its --set overrides."""

    config: str
    overrides: tuple[str, ...]
    job: AuditJob

    @property
    def reads(self) -> tuple[str, ...]:
        return ()

    def run(self) -> Result:
        return self.job(self.config, list(self.overrides))


@dataclasses.dataclass(frozen=True)
class Report:
    """`madp report RUN_DIR`: the page of the run's reports at `output` (None: RUN_DIR/report.html)."""

    run_dir: str
    output: str | None = None
    internal: bool = False

    @property
    def reads(self) -> tuple[str, ...]:
        return ()

    def run(self) -> Result:
        from madp.tools.report import write_report

        return write_report(self.run_dir, self.output, self.internal)


Step = Generate | Bound | VerifyBound | Batch | VerifyBatches | Calibrate | Train | Audit | Report
