"""The reports the stages write and the next stages read, as typed values: `BoundReport` (`madp bound`'s
OUTPUT/report.json) and `BatchReport` (`madp batch`'s, which carries the `BoundRecord` the batches were
made from). Each has `to_json()` (the object its file holds) and `from_json(data, where)` (from the parsed
object; `where` names the file in errors). Every file states its `format_version`; one without it is read
as the format before the key was written (the same keys), and a version this madp does not know is
refused. The independent verifiers (`madp.core.verify`) never read these classes: they read raw JSON.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from madp.core.errors import InputError
from madp.core.graph_digest import GraphDigest
from madp.core.user_ids import AS_IS

FORMAT_VERSION = 1  # of both reports: the keys below; a file without the key is their predecessor (the same keys)
VERSION_KEY = "format_version"


def check_format(data: Any, where: str, what: str, current: int = FORMAT_VERSION) -> None:
    """Refuse a parsed file that is not a JSON object (`what` names what it should be, e.g. "bound report"),
    or whose `format_version` this madp does not read (a newer madp's, or not a version): its format's
    `current` version and those before it are read."""
    if not isinstance(data, dict):
        raise InputError(f"{where} is not a madp {what} (a JSON {type(data).__name__}, not an object)")
    version = data.get(VERSION_KEY, current)
    if type(version) is not int or not 1 <= version <= current:
        raise InputError(
            f"{where}: format_version {version!r} is not one this madp reads (it reads {current}): written by "
            f"another madp; read it with that madp, or re-run the stage with this one"
        )


def _lists(values: Any) -> Any:
    """Tuples as lists, inside mappings too: what json.loads gives back."""
    if isinstance(values, (list, tuple)):
        return [_lists(value) for value in values]
    if isinstance(values, Mapping):
        return {key: _lists(value) for key, value in values.items()}
    return values


def _refuse_missing(data: Mapping[str, Any], required: tuple[str, ...], where: str, what: str) -> None:
    missing = [key for key in required if key not in data]
    if missing:
        raise InputError(f"{where} lacks {missing}: not a report of this madp {what}; re-run madp {what}")


def _parsed(parse, where: str, what: str):
    """`parse()`, its KeyError, TypeError or ValueError an InputError naming the report."""
    try:
        return parse()
    except InputError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise InputError(
            f"{where} is not a madp {what} report this madp reads ({type(error).__name__}: {error}); re-run madp {what}"
        ) from None


# --- files listed by a report ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FileEntry:
    """A file an output's report lists (`storage.manifest`): its name in the output, size and SHA-256."""

    name: str  # the file's name in the output (no folder)
    bytes: int  # its size
    sha256: str  # its SHA-256, hex

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "bytes": self.bytes, "sha256": self.sha256}

    @classmethod
    def from_json(cls, entry: object) -> FileEntry | None:
        """The entry as `storage.manifest` writes it: a plain name (no folder, so nothing outside the output is
        ever read), its size and its SHA-256; None for anything else."""
        if not isinstance(entry, dict):
            return None
        name, size, sha256 = entry.get("name"), entry.get("bytes"), entry.get("sha256")
        if not isinstance(name, str) or name in ("", ".", "..") or "/" in name.replace("\\", "/"):
            return None
        if not isinstance(size, int) or not isinstance(sha256, str):
            return None
        return cls(name, size, sha256)


def _file_entries(data: Mapping[str, Any], key: str, where: str, what: str) -> tuple[FileEntry, ...]:
    """The files a report lists under `key`, checked: a non-empty list of plain names with sizes and SHA-256."""
    listed = data.get(key)
    if not listed:
        raise InputError(f"{where} lists no {key}: re-run madp {what}")
    entries = [FileEntry.from_json(entry) for entry in listed] if isinstance(listed, list) else [None]
    if None in entries:
        raise InputError(
            f"{where}: {key} is not a list of files (name, bytes, sha256), as madp {what} writes it; re-run madp {what}"
        )
    return tuple(entry for entry in entries if entry is not None)


# --- madp bound ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BoundParameters:
    """The options the bound ran with, as its report records them (`parameters`)."""

    max_contributions: int  # K: records per user at most
    order: str = "arity"  # the universal preference: arity, hash, weight or alternate
    arity_threshold: int | None = None  # --order alternate: u, c1, c2 and the two groups' sizes
    small_run: int | None = None  # c1: small records per run
    large_run: int | None = None  # c2: large records per run
    group_sizes: tuple[int, int] | None = None  # records with <= u and > u users, as the engine counted them
    seed: int = 0  # of the hash that breaks ties in the order
    max_rounds: int | None = None  # --max-rounds (None: until converged)
    duplicates: bool = False  # the with-duplicates variant: passes over residual capacities, records get copies
    capacities: str | None = None  # the file of per-user capacities overriding K
    id_column: str = "id"  # the records' id column
    users_column: str | None = "users"  # None where --users-columns named them
    users_columns: tuple[str, ...] | None = None  # --users-columns: the users are their union
    user_ids: str | None = None  # --user-ids: how string user ids were read (None: checked)
    weight_column: str | None = None  # --weight-column (read and validated, and with --order weight the order)
    on_invalid: str = "error"  # error (invalid rows stop the bound) or skip (into OUTPUT/rejected/)

    def to_json(self) -> dict[str, Any]:
        return _lists({field.name: getattr(self, field.name) for field in dataclasses.fields(self)})

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> BoundParameters:
        """The parameters as written; those a report of an earlier madp lacks take what that madp did (a
        report from before --user-ids: the bound took every user id as it was)."""
        known = {field.name for field in dataclasses.fields(cls)}
        values = {key: value for key, value in data.items() if key in known}
        values["user_ids"] = data["user_ids"] if "user_ids" in data else AS_IS
        for key in ("group_sizes", "users_columns"):
            if values.get(key) is not None:
                values[key] = tuple(values[key])
        return cls(**values)


@dataclasses.dataclass(frozen=True)
class RoundStats:
    """One round of the bounding: its pass, the records it selected and those still eligible after it."""

    round: int  # its number, from 1
    pass_: int  # its pass (written as `pass`)
    selected: int  # records (copies) selected in it
    eligible: int  # records still eligible after it

    def to_json(self) -> dict[str, Any]:
        return {"round": self.round, "pass": self.pass_, "selected": self.selected, "eligible": self.eligible}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RoundStats:
        return cls(data["round"], data["pass"], data["selected"], data["eligible"])


@dataclasses.dataclass(frozen=True)
class Histograms:
    """The bound's distributions, {value: count} with string keys: users by their records in the input and
    after bounding, records by their users in the input and among the selected records."""

    records_per_user_input: Mapping[str, int]  # users by their records in the input
    records_per_user_selected: Mapping[str, int]  # users by their selected records (copies)
    records_by_users_input: Mapping[str, int]  # input records by their number of users
    records_by_users_selected: Mapping[str, int]  # selected records by their number of users

    def to_json(self) -> dict[str, Any]:
        return {field.name: dict(getattr(self, field.name)) for field in dataclasses.fields(self)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Histograms:
        return cls(**{field.name: dict(data[field.name]) for field in dataclasses.fields(cls)})


@dataclasses.dataclass(frozen=True)
class SparkFaults:
    """What Spark's driver saw fail under a `--runner pyspark` run and recovered from (the outputs are
    those of a run without it), as its status REST API tells it while the Spark UI is on: None where
    unknown (the UI off, or its API unreadable), never a guessed 0."""

    executors_lost: int | None  # executors removed during the run other than by the driver (a killed JVM, a lost host)
    tasks_retried: int | None  # task attempts of the run's jobs that failed and were run again

    def to_json(self) -> dict[str, Any]:
        return {"executors_lost": self.executors_lost, "tasks_retried": self.tasks_retried}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SparkFaults:
        return cls(data["executors_lost"], data["tasks_retried"])


BOUND_REPORT_KEYS = (
    "engine",
    "input",
    "parameters",
    "contribution_bound",
    "ignored_files",
    "input_rows",
    "input_records",
    "input_users",
    "rejected_total",
    "repeated_users_removed",
    "selected_records",
    "distinct_selected",
    "max_user_contribution",
    "rounds",
    "passes",
    "converged",
    "per_round",
    "histograms",
)


@dataclasses.dataclass(frozen=True)
class BoundReport:
    """`madp bound`'s OUTPUT/report.json: the selection files, the bound every user is held to, the input's
    figures and rejects, the rounds and the digest of the graph bounded. Every engine writes it; Beam and
    Spark add their partitions and runs."""

    engine: str  # which engine bounded: local, pyspark, or the Beam runner
    input: str  # the input records' path
    parameters: BoundParameters  # the options it ran with
    contribution_bound: int  # K, or a larger listed capacity: what the accountant assumes for every user
    ignored_files: tuple[str, ...]  # files of the input folder not read (their suffix)
    input_rows: int  # rows read
    input_records: int  # valid records
    input_users: int  # users of the valid records
    rejected: Mapping[str, int]  # rows dropped (--on-invalid skip), by reason
    rejected_total: int  # rows dropped
    repeated_users_removed: int  # a user repeated within a record, dropped
    graph_digest: GraphDigest | None  # None in a report of madp before it had one (batching refuses it)
    selected_records: int  # copies
    distinct_selected: int  # records selected at least once
    max_user_contribution: int  # the most records (copies) one user has in the selection
    rounds: int  # rounds run
    passes: int  # passes (more than one with --duplicates)
    converged: bool  # whether every record was decided (False: stopped at --max-rounds)
    per_round: tuple[RoundStats, ...]  # each round's figures
    histograms: Histograms  # the distributions of users and records
    selection_files: tuple[FileEntry, ...]  # the selection files, with size and SHA-256
    partitions: int | None = None  # Beam and Spark: the partitions of each side
    # Beam: each pipeline run's iterations and counters; Spark: its one job's iterations
    pipeline_runs: tuple[Mapping[str, Any], ...] | None = None
    spark_faults: SparkFaults | None = None  # Spark: the executors lost and tasks retried under the run
    # The engine's run time, in what a run returns and prints, never in the file: it depends on the machine's
    # load and on more of the input than the graph (parsing JSON Lines rows reads their content too)
    wall_time_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        """The report as its file holds it (written with sorted keys), and the wall time where it has one."""
        report: dict[str, Any] = {
            VERSION_KEY: FORMAT_VERSION,
            "engine": self.engine,
            "input": self.input,
            "parameters": self.parameters.to_json(),
            "contribution_bound": self.contribution_bound,
            "ignored_files": list(self.ignored_files),
            "input_rows": self.input_rows,
            "input_records": self.input_records,
            "input_users": self.input_users,
            "rejected": dict(self.rejected),
            "rejected_total": self.rejected_total,
            "repeated_users_removed": self.repeated_users_removed,
            "graph_digest": None if self.graph_digest is None else self.graph_digest.to_report(),
            "selected_records": self.selected_records,
            "distinct_selected": self.distinct_selected,
            "max_user_contribution": self.max_user_contribution,
            "rounds": self.rounds,
            "passes": self.passes,
            "converged": self.converged,
            "per_round": [one.to_json() for one in self.per_round],
        }
        if self.partitions is not None:
            report["partitions"] = self.partitions
        report["histograms"] = self.histograms.to_json()
        if self.pipeline_runs is not None:
            report["pipeline_runs"] = _lists(self.pipeline_runs)
        if self.spark_faults is not None:
            report["spark_faults"] = self.spark_faults.to_json()
        report["selection_files"] = [entry.to_json() for entry in self.selection_files]
        if self.wall_time_s is not None:
            report["wall_time_s"] = self.wall_time_s
        return report

    @classmethod
    def from_json(cls, data: Any, where: str) -> BoundReport:
        """The report of a parsed report.json (`where` names it in errors)."""
        check_format(data, where, "bound report")
        selection_files = _file_entries(data, "selection_files", where, "bound")
        _refuse_missing(data, BOUND_REPORT_KEYS, where, "bound")

        def parse() -> BoundReport:
            runs, faults = data.get("pipeline_runs"), data.get("spark_faults")
            return cls(
                engine=data["engine"],
                input=data["input"],
                parameters=BoundParameters.from_json(data["parameters"]),
                contribution_bound=data["contribution_bound"],
                ignored_files=tuple(data["ignored_files"]),
                input_rows=data["input_rows"],
                input_records=data["input_records"],
                input_users=data["input_users"],
                rejected=dict(data.get("rejected", {})),
                rejected_total=data["rejected_total"],
                repeated_users_removed=data["repeated_users_removed"],
                graph_digest=_graph_digest(data.get("graph_digest")),
                selected_records=data["selected_records"],
                distinct_selected=data["distinct_selected"],
                max_user_contribution=data["max_user_contribution"],
                rounds=data["rounds"],
                passes=data["passes"],
                converged=data["converged"],
                per_round=tuple(RoundStats.from_json(one) for one in data["per_round"]),
                histograms=Histograms.from_json(data["histograms"]),
                selection_files=selection_files,
                partitions=data.get("partitions"),
                pipeline_runs=None if runs is None else tuple(runs),
                spark_faults=None if faults is None else SparkFaults.from_json(faults),
                wall_time_s=data.get("wall_time_s"),
            )

        return _parsed(parse, where, "bound")


def _graph_digest(value: object) -> GraphDigest | None:
    """A report's graph digest; None where it has none of this scheme (`madp batch` refuses that bound)."""
    try:
        return GraphDigest.from_json(value)
    except ValueError:
        return None


# --- madp batch ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BoundRecord:
    """What a batch report records of the bound its batches were made from, for the accountant: the bound
    its users are held to, the largest contribution found, its users, parameters, selection files and graph
    digest, and the rows it dropped (which rows are valid is treated as public)."""

    contribution_bound: int  # K, or a larger listed capacity: what the accountant assumes
    max_user_contribution: int  # the most records one user has in the selection
    input_users: int  # users of the valid records
    parameters: BoundParameters  # the bound's options
    selection_files: tuple[FileEntry, ...]  # the selection files, with size and SHA-256
    graph_digest: GraphDigest | None  # the bounded graph's digest, which DATA matched
    rejected: Mapping[str, int]  # rows the bound dropped, by reason

    @classmethod
    def of(cls, bound: BoundReport) -> BoundRecord:
        return cls(
            bound.contribution_bound,
            bound.max_user_contribution,
            bound.input_users,
            bound.parameters,
            bound.selection_files,
            bound.graph_digest,
            bound.rejected,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "contribution_bound": self.contribution_bound,
            "max_user_contribution": self.max_user_contribution,
            "input_users": self.input_users,
            "parameters": self.parameters.to_json(),
            "selection_files": [entry.to_json() for entry in self.selection_files],
            "graph_digest": None if self.graph_digest is None else self.graph_digest.to_report(),
            "rejected": dict(self.rejected),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], where: str) -> BoundRecord:
        return cls(
            data["contribution_bound"],
            data["max_user_contribution"],
            data["input_users"],
            BoundParameters.from_json(data["parameters"]),
            _file_entries(data, "selection_files", f"{where} (its bound)", "bound"),
            _graph_digest(data.get("graph_digest")),
            dict(data.get("rejected", {})),
        )


@dataclasses.dataclass(frozen=True)
class BatchParameters:
    """The options the batches were made with, as their report records them (`parameters`)."""

    steps: int  # T: training steps
    batch_size: float  # B: expected (minsep) or exact (minsep-greedy) batch size
    min_sep: int  # b (the one found by --find-max-min-sep where it searched)
    batch_size_counts: str  # "records", or "users" for --sampler users
    warm_up: int  # simulated steps dropped first
    max_batch_size: int | None  # B_max: steps padded and truncated to it
    seed: int | None  # --seed (None: a fresh secret key)
    output_shards: int  # TFRecord files
    on_invalid: str  # error or skip (rows into OUTPUT/rejected/)
    content_columns: tuple[str, ...]  # the columns carried into the rows

    def to_json(self) -> dict[str, Any]:
        """As the report holds them, keys sorted: a privacy plan states them in that order (`AccountedBatches`)."""
        return _lists({name: getattr(self, name) for name in sorted(field.name for field in dataclasses.fields(self))})

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> BatchParameters:
        return cls(**{**data, "content_columns": tuple(data["content_columns"])})


@dataclasses.dataclass(frozen=True)
class SizeSummary:
    """Batch sizes over the steps: mean, standard deviation, extremes and each step's."""

    mean: float  # mean over the steps
    std: float  # standard deviation
    min: int  # the smallest step's
    max: int  # the largest step's
    per_step: tuple[int, ...] | None  # None in a report of madp before it recorded them

    def to_json(self) -> dict[str, Any]:
        summary: dict[str, Any] = {"mean": self.mean, "std": self.std, "min": self.min, "max": self.max}
        if self.per_step is not None:
            summary["per_step"] = list(self.per_step)
        return summary

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SizeSummary:
        per_step = data.get("per_step")
        return cls(data["mean"], data["std"], data["min"], data["max"], None if per_step is None else tuple(per_step))


@dataclasses.dataclass(frozen=True)
class Participation:
    """How the written rows' users take part: their number, the most steps and rows of one user, the
    smallest gap between two of a user's steps and every gap's count."""

    users: int  # users with a written row
    max_participations: int  # the most steps one user is in
    max_rows: int  # the most rows one user has
    min_gap: int | None  # None where no user takes part twice
    user_rows_sharing_a_step: int  # rows of a user beyond its first in a step
    gap_histogram: Mapping[str, int]  # gaps between a user's consecutive steps: {gap: count}

    def to_json(self) -> dict[str, Any]:
        return {
            **{field.name: getattr(self, field.name) for field in dataclasses.fields(self)},
            "gap_histogram": dict(self.gap_histogram),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Participation:
        return cls(**{**data, "gap_histogram": dict(data["gap_histogram"])})


BATCH_REPORT_KEYS = (
    "engine",
    "selected",
    "data",
    "sampler",
    "parameters",
    "sampling_probability",
    "expected_batch_size",
    "steps",
    "records",
    "units",
    "batch_sizes",
    "relative_error_to_target",
    "written_batch_sizes",
    "warm_up_batch_sizes",
    "truncated_rows",
    "padding_rows",
    "records_never_written",
    "participation",
    "rejected",
    "rejected_total",
    "wall_time_s",
)


@dataclasses.dataclass(frozen=True)
class BatchReport:
    """`madp batch`'s OUTPUT/report.json: what the batches were made from (the selection, the records and the
    `BoundRecord`), how (the sampler, its parameters, p), what they hold (sizes, participations, rejects)
    and the batch files. The trainer's accounting reads it (`Batches.report`)."""

    engine: str  # which engine batched: local, pyspark, or the Beam runner
    selected: str  # the bound output the batches were made from (absolute where local)
    data: str  # the records (absolute where local)
    sampler: str  # minsep, minsep-greedy or users
    bound: BoundRecord | None  # None in a report of madp before it recorded the bound
    parameters: BatchParameters  # the options it ran with
    sampling: str | None  # what the sampling rests on; None in a report of madp before secret keys (a fixed seed)
    sampling_probability: float | None  # p (Poisson samplers)
    expected_batch_size: float | None  # the stationary expected batch size at p (Poisson samplers)
    steps: int  # T
    records: int  # selected records joined with DATA
    units: int  # what a step samples from: copies, or users (users sampler)
    batch_sizes: SizeSummary  # sampled, after warm-up
    relative_error_to_target: float  # mean sampled batch size over B, minus 1
    written_batch_sizes: SizeSummary  # the real rows each step's file holds
    warm_up_batch_sizes: tuple[int, ...]  # the dropped warm-up steps' sizes
    truncated_rows: int  # rows cut by --max-batch-size
    padding_rows: int  # weight-0 rows padding steps to --max-batch-size
    records_never_written: int  # selected records in no written row
    participation: Participation  # how the written rows' users take part
    rejected: Mapping[str, int]  # records left out (--on-invalid skip), by reason
    rejected_total: int  # records left out
    files: tuple[FileEntry, ...]  # the batch files, with size and SHA-256
    wall_time_s: float  # the batching's wall time
    users_per_step: SizeSummary | None = None  # --sampler users: users sampled per step
    min_sep_search: tuple[Mapping[str, Any], ...] | None = None  # --sampler minsep-greedy: the b tried
    k: int | None = None  # --sampler minsep-greedy: the most participations of a record
    partitions: int | None = None  # Beam and Spark: the partitions
    beam_counters_per_run: tuple[Mapping[str, Any], ...] | None = None  # Beam: the pipeline's counters
    spark_faults: SparkFaults | None = None  # Spark: the executors lost and tasks retried under the run

    def to_json(self) -> dict[str, Any]:
        """The report as its file holds it (written with sorted keys)."""
        report: dict[str, Any] = {
            VERSION_KEY: FORMAT_VERSION,
            "engine": self.engine,
            "selected": self.selected,
            "data": self.data,
            "sampler": self.sampler,
            "bound": None if self.bound is None else self.bound.to_json(),
            "parameters": self.parameters.to_json(),
            "sampling": self.sampling,
            "sampling_probability": self.sampling_probability,
            "expected_batch_size": self.expected_batch_size,
            "steps": self.steps,
            "records": self.records,
            "units": self.units,
            "batch_sizes": self.batch_sizes.to_json(),
            "relative_error_to_target": self.relative_error_to_target,
            "written_batch_sizes": self.written_batch_sizes.to_json(),
            "warm_up_batch_sizes": list(self.warm_up_batch_sizes),
            "truncated_rows": self.truncated_rows,
            "padding_rows": self.padding_rows,
            "records_never_written": self.records_never_written,
            "participation": self.participation.to_json(),
            "rejected": dict(self.rejected),
            "rejected_total": self.rejected_total,
            "files": [entry.to_json() for entry in self.files],
            "wall_time_s": self.wall_time_s,
        }
        if self.users_per_step is not None:
            report["users_per_step"] = self.users_per_step.to_json()
        if self.min_sep_search is not None:
            report["min_sep_search"] = _lists(self.min_sep_search)
        if self.k is not None:
            report["k"] = self.k
        if self.partitions is not None:
            report["partitions"] = self.partitions
        if self.beam_counters_per_run is not None:
            report["beam_counters_per_run"] = _lists(self.beam_counters_per_run)
        if self.spark_faults is not None:
            report["spark_faults"] = self.spark_faults.to_json()
        return report

    @classmethod
    def from_json(cls, data: Any, where: str) -> BatchReport:
        """The report of a parsed report.json (`where` names it in errors)."""
        check_format(data, where, "batch report")
        files = _file_entries(data, "files", where, "batch")
        _refuse_missing(data, BATCH_REPORT_KEYS, where, "batch")

        def parse() -> BatchReport:
            bound, users, search, counters, faults = (
                data.get(key)
                for key in ("bound", "users_per_step", "min_sep_search", "beam_counters_per_run", "spark_faults")
            )
            return cls(
                engine=data["engine"],
                selected=data["selected"],
                data=data["data"],
                sampler=data["sampler"],
                bound=None if not bound else BoundRecord.from_json(bound, where),
                parameters=BatchParameters.from_json(data["parameters"]),
                sampling=data.get("sampling"),
                sampling_probability=data["sampling_probability"],
                expected_batch_size=data["expected_batch_size"],
                steps=data["steps"],
                records=data["records"],
                units=data["units"],
                batch_sizes=SizeSummary.from_json(data["batch_sizes"]),
                relative_error_to_target=data["relative_error_to_target"],
                written_batch_sizes=SizeSummary.from_json(data["written_batch_sizes"]),
                warm_up_batch_sizes=tuple(data["warm_up_batch_sizes"]),
                truncated_rows=data["truncated_rows"],
                padding_rows=data["padding_rows"],
                records_never_written=data["records_never_written"],
                participation=Participation.from_json(data["participation"]),
                rejected=dict(data["rejected"]),
                rejected_total=data["rejected_total"],
                files=files,
                wall_time_s=data["wall_time_s"],
                users_per_step=None if users is None else SizeSummary.from_json(users),
                min_sep_search=None if search is None else tuple(search),
                k=data.get("k"),
                partitions=data.get("partitions"),
                beam_counters_per_run=None if counters is None else tuple(counters),
                spark_faults=None if faults is None else SparkFaults.from_json(faults),
            )

        return _parsed(parse, where, "batch")

    @property
    def max_rows_per_step(self) -> int:
        """Rows of the largest step in the files: B_max where steps are padded to it, else the largest batch."""
        return int(self.parameters.max_batch_size or self.written_batch_sizes.max)

    @property
    def rows_per_step(self) -> list[int] | None:
        """The rows each step of the batches holds, padding rows (which carry their step) included: B_max for
        every step where steps are padded to it, else each step's written rows; None for a report of madp
        before it recorded those (unpadded batches)."""
        padded_to = self.parameters.max_batch_size
        if padded_to:
            return [int(padded_to)] * int(self.steps)
        written = self.written_batch_sizes.per_step
        return None if written is None else [int(rows) for rows in written]


# --- madp audit ----------------------------------------------------------------------------------

AUDIT_FORMAT_VERSION = 1  # of audit.json; a file without the key is its predecessor (the same keys)


@dataclasses.dataclass(frozen=True)
class CanaryScore:
    """One canary user of an audit: whether its records were included, and its score (the model's loss)."""

    user: int | str  # the canary user
    included: bool  # whether its records were trained on
    score: float  # its score: the model's loss on its records

    def to_json(self) -> dict[str, Any]:
        return {"user": self.user, "included": self.included, "score": self.score}


@dataclasses.dataclass(frozen=True)
class AuditReport:
    """`madp audit`'s audit.json: the canaries planted and guessed, the lower bound on epsilon measured and
    what it can measure at most, the claim it checks (the audit model's plan) and the verdict."""

    config: str  # the audited job's config
    output: str  # the audit's directory
    canaries: int  # canary users planted
    canary_records: int  # their records
    shared_records: int  # canary records shared by two canaries
    included: int  # canaries whose records were trained on (the rest zeroed out)
    guesses: int  # inclusion guesses made
    correct_guesses: int  # guesses that were right
    epsilon_lower_bound: float  # epsilon the correct guesses prove at the confidence
    confidence: float  # the confidence of that lower bound
    largest_measurable_epsilon: float  # the most this many canaries can prove
    delta: float  # the delta of the lower bound and the claim
    claimed_epsilon: float | None  # None for a non-private audit model: no claim to check
    mechanism: str  # the audit model's mechanism (none: not private)
    noise_multiplier: float | None  # its sigma
    noise: str | None  # how its noise key was made (secret, or a seed)
    non_private: bool  # the audit trained without privacy on purpose
    testing_noise_scale: float | None  # the testing-only noise scale (not 1: a broken mechanism on purpose)
    can_refute_claim: bool  # whether the claim lies below largest_measurable_epsilon
    audit_model_private: bool  # whether the audit model has a privacy plan
    inclusion: str  # what the canaries' inclusion rests on (a secret key, or a seed)
    candidates: tuple[Mapping[str, Any], ...]  # every guess plan tried, with its correct guesses and lower bound
    ok: bool  # false where the lower bound refutes the claim
    verdict: str  # the outcome in words
    per_canary: tuple[CanaryScore, ...]  # each canary's score

    def to_json(self) -> dict[str, Any]:
        """audit.json's content."""
        audit: dict[str, Any] = {VERSION_KEY: AUDIT_FORMAT_VERSION}
        audit.update({field.name: getattr(self, field.name) for field in dataclasses.fields(self)})
        audit.update(candidates=list(self.candidates), per_canary=[one.to_json() for one in self.per_canary])
        return audit

    def summary(self) -> dict[str, Any]:
        """What `madp audit` prints (and its error carries): the file's figures without the canaries' scores."""
        return {key: value for key, value in self.to_json().items() if key not in (VERSION_KEY, "per_canary")}

    @classmethod
    def from_json(cls, data: Any, where: str) -> AuditReport:
        """The audit of a parsed audit.json (`where` names it in errors)."""
        check_format(data, where, "audit report", AUDIT_FORMAT_VERSION)

        def parse() -> AuditReport:
            known = {field.name for field in dataclasses.fields(cls)}
            values = {key: value for key, value in data.items() if key in known}
            return cls(
                **{
                    **values,
                    "candidates": tuple(data["candidates"]),
                    "per_canary": tuple(CanaryScore(**one) for one in data["per_canary"]),
                }
            )

        return _parsed(parse, where, "audit")
