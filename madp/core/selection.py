"""Bounding outputs shared by both engines: options, capacities, the selection files (written here, read by
the batching and the trainer), report."""

from __future__ import annotations

import codecs
import dataclasses
import io
import json
import posixpath
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv

from madp.core import storage
from madp.core.bounding import ORDERS, AlternateRuns, Capacities, Control
from madp.core.errors import InputError
from madp.core.graph_digest import GraphDigest
from madp.core.hashing import partition_of
from madp.core.options import option, refuse_failed, seed_argument
from madp.core.record_reading import jsonl_lines, parse_row
from madp.core.records import ColumnOptions, Columns, Rejects, duplicate_id_mask, ignored_input_files
from madp.core.reports import BatchReport, BoundParameters, BoundReport, FileEntry, Histograms, RoundStats

SELECTED_DIR = "selected"
REJECTED_DIR = "rejected"
REPORT_FILE = "report.json"
WORK_DIR = (
    "_work"  # a partitioned engine's files while it runs (kept errors, checkpoints, attempts), removed at the end
)
_ERROR_EXAMPLES = 10


# Valid input records per selection file when --output-shards is not given (a file of at most ~16 MB).
RECORDS_PER_SHARD = 1_000_000


@dataclasses.dataclass(frozen=True)
class BoundOptions(ColumnOptions):
    """The options of `madp bound` (each field its `--flag`), checked when built; `group_sizes` is the
    engines' count, no option."""

    max_contributions: int = option(aliases=("-k",), help="K: records per user at most")
    order: str = option(
        "arity",
        choices=ORDERS,
        help="universal preference: fewer users first (default), seeded hash, higher weight first, "
        "or alternate runs of small and large records (bias mitigation)",
    )
    weight_column: str | None = option(None, help="column of record weights for --order weight")
    arity_threshold: int | None = option(  # --order alternate: u, and the run lengths c1 and c2
        None, help="--order alternate: u, records with at most u users are 'small' (It's my data too, 5.5)"
    )
    small_run: int | None = option(None, help="--order alternate: c1, small records per run")
    large_run: int | None = option(None, help="--order alternate: c2, large records per run")
    seed: int = option(0, parse=seed_argument, help="seed of the hash that breaks ties in the order")
    capacities: str | None = option(None, help="file (.csv/.jsonl/.parquet) of rows user, capacity overriding K")
    max_rounds: int | None = option(None, help="stop after R rounds (default: until converged)")
    duplicates: bool = option(
        False, help="with-duplicates variant: passes over residual capacities; records get copies"
    )
    on_invalid: str = option(
        "error",
        choices=("error", "skip"),
        help="invalid rows stop the run (default) or are skipped into OUTPUT/rejected/",
    )
    output_shards: int | None = option(  # None: one per RECORDS_PER_SHARD valid input records (`shards`)
        None, help="Parquet files in OUTPUT/selected/ (default: one per 1,000,000 valid input records)"
    )
    group_sizes: tuple[int, int] | None = None  # records with <= u and > u users; counted by the engines

    def __post_init__(self) -> None:
        super().__post_init__()
        alternate = (self.arity_threshold, self.small_run, self.large_run)
        refuse_failed(
            [
                (
                    self.order != "alternate" or all(isinstance(v, int) and v >= 1 for v in alternate),
                    "{order} alternate needs {arity_threshold}, {small_run} and {large_run} (integers >= 1)",
                ),
                (
                    self.order == "alternate" or all(v is None for v in alternate),
                    "{arity_threshold}, {small_run} and {large_run} apply to {order} alternate",
                ),
                (self.max_contributions >= 1, "{max_contributions} must be at least 1"),
                (self.order != "weight" or bool(self.weight_column), "{order} weight needs {weight_column}"),
                (self.max_rounds is None or self.max_rounds >= 1, "{max_rounds} must be at least 1"),
                (self.output_shards is None or self.output_shards >= 1, "{output_shards} must be at least 1"),
            ]
        )

    @property
    def columns(self) -> Columns:
        return self.record_columns(self.weight_column)

    def shards(self, input_records: int) -> int:
        """The selection's Parquet files: --output-shards, else one per RECORDS_PER_SHARD valid input
        records, so that no one worker writes (or holds) a large input's whole selection."""
        if self.output_shards is not None:
            return self.output_shards
        return max(1, -(-input_records // RECORDS_PER_SHARD))

    @property
    def alternate(self) -> tuple[int, int, int]:
        """(u, c1, c2) of --order alternate, which construction checked."""
        if self.arity_threshold is None or self.small_run is None or self.large_run is None:
            raise ValueError("not --order alternate")
        return self.arity_threshold, self.small_run, self.large_run


def alternate_runs(options: BoundOptions) -> AlternateRuns | None:
    """The run structure of --order alternate once the engine has counted the groups (else None)."""
    if options.order != "alternate":
        return None
    if options.group_sizes is None:
        raise ValueError("the engine must count the records of each group first (group_sizes)")
    return AlternateRuns(*options.alternate, *options.group_sizes)


def group_sizes(arity, threshold: int) -> tuple[int, int]:
    """(records with at most `threshold` users, records with more)."""
    small = int((arity <= threshold).sum())
    return small, len(arity) - small


# The report's distributions, as counts named so that sums over partitions merge them.
HISTOGRAMS = {
    "records_per_user_input": "users_with_input_records_",
    "records_per_user_selected": "users_with_selected_records_",
    "records_by_users_input": "input_records_with_users_",
    "records_by_users_selected": "selected_records_with_users_",
}


def user_distribution_stats(degree: np.ndarray, contribution: np.ndarray) -> dict[str, int]:
    """Users by their records in the input and by their selected records (copies)."""
    return {
        **_named_counts(HISTOGRAMS["records_per_user_input"], degree),
        **_named_counts(HISTOGRAMS["records_per_user_selected"], contribution),
    }


def record_distribution_stats(arity: np.ndarray, copies: np.ndarray) -> dict[str, int]:
    """Records by their number of users, in the input and among the selected (distinct) records."""
    return {
        **_named_counts(HISTOGRAMS["records_by_users_input"], arity),
        **_named_counts(HISTOGRAMS["records_by_users_selected"], arity[copies > 0]),
    }


def stat_total(name: str, values: Iterable[int]) -> int:
    """A count that the steps of a partitioned engine sent under `name`, over them all: summed, or the
    largest of a `max_` one."""
    return max(values) if name.startswith("max_") else sum(values)


def _named_counts(prefix: str, values: np.ndarray) -> dict[str, int]:
    found, counts = np.unique(np.asarray(values, dtype=np.int64), return_counts=True)
    return {f"{prefix}{int(v):09d}": int(c) for v, c in zip(found, counts)}


def histograms(stats: Mapping[str, int]) -> dict[str, dict[str, int]]:
    """{histogram: {value: count}} from summed distribution stats."""
    return {
        name: {str(int(key[len(prefix) :])): count for key, count in sorted(stats.items()) if key.startswith(prefix)}
        for name, prefix in HISTOGRAMS.items()
    }


def read_capacities(path: str, default: int) -> Capacities:
    """Rows (user, capacity) from CSV (user ids as text), JSONL or Parquet (typed user ids);
    integer capacity >= 0, users unique."""
    if not path.endswith((".csv", ".jsonl", ".parquet")):
        raise InputError(f"{path}: capacities must be .csv, .jsonl or .parquet")
    if storage.kind(path) != "file":
        raise InputError(f"{path}: no such capacities file")
    try:
        table = _capacities_table(path)
    except (pa.ArrowInvalid, pa.ArrowTypeError, ValueError, OSError) as error:
        raise InputError(f"{path}: not a readable capacities file: {error}") from error
    if not {"user", "capacity"} <= set(table.column_names):
        raise InputError(f"{path}: capacities need columns 'user' and 'capacity' (found {table.column_names})")
    users, capacity = table.column("user").combine_chunks(), table.column("capacity").combine_chunks()
    if not pa.types.is_integer(capacity.type) and not (pa.types.is_null(capacity.type) and len(capacity) == 0):
        raise InputError(f"{path}: column 'capacity' must hold integers, found {capacity.type}")
    values = capacity.to_numpy(zero_copy_only=False)
    missing_user = users.is_null().to_numpy(zero_copy_only=False)
    problems = [(row, "missing user") for row in np.flatnonzero(missing_user)]
    problems += [
        (row, "missing or negative capacity")
        for row in np.flatnonzero(
            capacity.is_null().to_numpy(zero_copy_only=False) | (np.nan_to_num(values, nan=-1) < 0)
        )
    ]
    present = np.flatnonzero(~missing_user)
    problems += [(row, "user listed twice") for row in present[duplicate_id_mask(users.take(pa.array(present)))]]
    if problems:
        listed = "; ".join(f"row {row}: {why}" for row, why in sorted(problems)[:_ERROR_EXAMPLES])
        raise InputError(f"{path}: {len(problems)} invalid capacity rows: {listed}")
    if pa.types.is_integer(users.type) or pa.types.is_null(users.type):
        users = users.cast(pa.int64())
    elif pa.types.is_string(users.type) or pa.types.is_large_string(users.type):
        users = users.cast(pa.string())
    else:
        raise InputError(f"{path}: column 'user' must hold integer or string user ids, found {users.type}")
    return Capacities(default=default, user_ids=users, values=values.astype(np.int64), text_ids=path.endswith(".csv"))


def _capacities_table(path: str) -> pa.Table:
    if path.endswith(".parquet"):
        return storage.read_parquet(path)
    if path.endswith(".csv"):  # a CSV cannot say whether user 007 is a number: keep its text
        with storage.open_input(path) as handle:
            data = handle.read()
        # A byte order mark (Excel writes one) is not part of the first column's name; the verifier
        # strips it too, so both read the same header.
        data = data.removeprefix(codecs.BOM_UTF8)
        return pa_csv.read_csv(
            io.BytesIO(data), convert_options=pa_csv.ConvertOptions(column_types={"user": pa.string()})
        )
    rows = []
    for number, line in enumerate(jsonl_lines(path)):
        row = parse_row(line)
        if not isinstance(row, dict):
            raise ValueError(f"row {number} is not a JSON object")
        rows.append(row)
    return pa.Table.from_pylist(rows)


def handle_rejects(rejects: Rejects, on_invalid: str, output: str) -> None:
    """Stop on invalid rows (--on-invalid error, the default), or write every skipped row to OUTPUT/rejected/."""
    if not len(rejects):
        return
    if on_invalid == "error":
        rows = sorted(zip(rejects.file, rejects.row, rejects.reason))
        examples = "\n".join(f"  {file}: row {row}: {reason}" for file, row, reason in rows[:_ERROR_EXAMPLES])
        totals = ", ".join(f"{reason}: {count}" for reason, count in rejects.counts().items())
        raise InputError(
            f"{len(rejects)} invalid input rows ({totals}); rows count from 0:\n{examples}\n"
            f"Fix them, or pass --on-invalid skip to drop them into {output}/{REJECTED_DIR}/"
        )
    storage.write_text(storage.join(output, REJECTED_DIR, "rejected.jsonl"), rejects.to_jsonl())


def shard_path(output: str, shard: int, shards: int) -> str:
    return storage.join(output, SELECTED_DIR, f"part-{shard:05d}-of-{shards:05d}.parquet")


def selection_manifest(output: str, shards: int) -> list[dict]:
    """`selection_files` of the report: the one definition of the selection, for every consumer."""
    return storage.manifest([shard_path(output, shard, shards) for shard in range(shards)])


def selection_files(selected: str) -> list[str]:
    """The selection shards of a finished `madp bound` output, exactly those its report lists."""
    return read_manifest(selected, "bound", SELECTED_DIR, read_bound_report(selected).selection_files)


def read_manifest(
    output: str,
    what: str,
    directory: str,
    listed: tuple[FileEntry, ...],
    counts: Callable[[str], bool] = lambda name: True,
) -> list[str]:
    """The files `listed` by an output's report (in `directory` of it), checked: every listed file must have
    its recorded size and SHA-256, and `directory` must hold no other file for which `counts(name)` is true
    (by default any file, hidden ones included)."""
    root = storage.join(output, directory) if directory else output
    present = (
        {posixpath.relpath(path, root): path for path in storage.list_files(root)}
        if storage.kind(root) == "directory"
        else {}
    )
    expected = {entry.name: entry for entry in listed}
    missing = sorted(set(expected) - set(present))
    extra = sorted(name for name in set(present) - set(expected) if counts(name))
    if missing or extra:
        raise InputError(
            f"{root}: "
            + "; ".join(
                part
                for part in (
                    f"missing {missing}" if missing else "",
                    f"files the {what} did not write {extra}" if extra else "",
                )
                if part
            )
            + f" (its {REPORT_FILE} lists {sorted(expected)}); re-run madp {what}"
        )
    for name, entry in sorted(expected.items()):
        path = present[name]
        if storage.size(path) != entry.bytes or storage.sha256(path) != entry.sha256:
            raise InputError(f"{path} is not the file madp {what} wrote (size or SHA-256 differ); re-run madp {what}")
    return [present[name] for name in sorted(expected)]


def read_report(output: str, what: str) -> dict:
    """OUTPUT/report.json of a finished `madp WHAT`: a JSON object, or an InputError naming it (a
    missing one means an unfinished run; an empty, truncated or other JSON one was not written by madp)."""
    report_path = storage.join(output, REPORT_FILE)
    if storage.kind(report_path) != "file":
        raise InputError(
            f"{output}: no {REPORT_FILE}: not a finished `madp {what}` output (its report is written "
            f"last; re-run madp {what})"
        )
    try:
        report = json.loads(storage.read_text(report_path))
    except ValueError as error:  # not JSON, or not UTF-8
        raise InputError(
            f"{report_path} is not a madp {what} report (not JSON: {error}); re-run madp {what}"
        ) from error
    if not isinstance(report, dict):
        raise InputError(
            f"{report_path} is not a madp {what} report (a JSON {type(report).__name__}, not an object); "
            f"re-run madp {what}"
        )
    return report


def read_bound_report(output: str) -> BoundReport:
    """The report of a finished `madp bound` OUTPUT, checked (`BoundReport.from_json`)."""
    return BoundReport.from_json(read_report(output, "bound"), storage.join(output, REPORT_FILE))


def sorted_selection(ids: pa.Array, copies: np.ndarray) -> pa.Table:
    """The selection table (id, copies), sorted by id: both engines write exactly this."""
    order = pc.sort_indices(ids)
    return pa.table({"id": ids.take(order), "copies": pa.array(copies[order.to_numpy()], type=pa.int64())})


def write_missing_shards(output: str, shards: int) -> None:
    """Write each of the `shards` output shards that no partition wrote (no record at all) empty."""
    for shard in range(shards):
        if storage.kind(shard_path(output, shard, shards)) == "missing":
            write_selection_shard(
                shard_path(output, shard, shards), sorted_selection(pa.array([], pa.int64()), np.zeros(0, np.int64))
            )


def selection_shard(tables: list[pa.Table]) -> pa.Table:
    """One output shard from the parts of it that the partitions of a partitioned engine selected: as
    the local engine writes it (`sorted_selection`)."""
    table = pa.concat_tables(tables)
    return sorted_selection(table["id"].combine_chunks(), table["copies"].to_numpy())


def selection_shards(ids: pa.Array, copies: np.ndarray, shards: int) -> dict[int, pa.Table]:
    """The selection split into output shards by id hash."""
    shard_of = partition_of(ids, shards) if len(ids) else np.zeros(0, dtype=np.int64)
    return {
        shard: sorted_selection(ids.filter(pa.array(shard_of == shard)), copies[shard_of == shard])
        for shard in range(shards)
    }


def read_selection_file(path: str) -> tuple[pa.Array, np.ndarray]:
    """One selection file's ids and copies (`selection_arrays`), read with its checksums."""
    return selection_arrays(storage.read_parquet(path), path)


def selection_arrays(table: pa.Table, where: str) -> tuple[pa.Array, np.ndarray]:
    """A selection table's ids (integers as int64) and copies, checked: `where` names it in errors."""
    if not {"id", "copies"} <= set(table.column_names):
        raise InputError(f"{where}: a selection needs columns id and copies (found {table.column_names})")
    ids, copies = table.column("id").combine_chunks(), table.column("copies").combine_chunks()
    if (
        ids.null_count
        or copies.null_count
        or not pa.types.is_integer(copies.type)
        or (len(copies) and pc.min(copies).as_py() < 1)
    ):
        raise InputError(f"{where}: ids must be present and copies integers >= 1")
    if pa.types.is_integer(ids.type):
        ids = ids.cast(pa.int64())
    return ids, copies.to_numpy(zero_copy_only=False).astype(np.int64)


def write_selection_shard(path: str, table: pa.Table) -> None:
    storage.write_parquet(table, path)


def write_report(output: str, report: BoundReport | BatchReport) -> None:
    """OUTPUT/report.json (the report's `to_json()`), keys sorted."""
    text = json.dumps(report.to_json(), indent=2, sort_keys=True) + "\n"
    storage.write_text(storage.join(output, REPORT_FILE), text)


def prepare_output(output: str) -> None:
    """Clear the results of an earlier run (and only those) so that no stale shard survives; its rejects go
    with their folder, which a run writes only where it skips rows."""
    storage.clear_directory(storage.join(output, SELECTED_DIR))
    storage.remove_tree(storage.join(output, REJECTED_DIR))
    storage.remove_file(storage.join(output, REPORT_FILE))


def contribution_bound(options: BoundOptions) -> int:
    """The most records (copies) any user may have in the selection: K, or a larger listed capacity.
    This, not K alone, is what the accountant must assume for every user."""
    return largest_capacity(options.max_contributions, options.capacities)


def largest_capacity(max_contributions: int, capacities: str | None) -> int:
    """K, or the largest capacity the `capacities` file lists if that is larger."""
    if not capacities:
        return max_contributions
    listed = read_capacities(capacities, max_contributions).listed[1]
    return max([max_contributions, *listed.tolist()])


class InputFigures(NamedTuple):
    """What an engine read of the input: its rows, valid records and their users, the rows rejected and
    the repeated users removed from records."""

    rows: int
    records: int
    users: int
    rejects: Rejects
    repeated_users_removed: int


class BoundOutcome(NamedTuple):
    """What the bounding found: the selection's copies and distinct records, the largest contribution, the
    rounds (`Control.per_round`) and passes, whether it converged, and the distribution stats summed
    (named counts of `HISTOGRAMS`; other names are ignored)."""

    selected_records: int
    distinct_selected: int
    max_user_contribution: int
    per_round: tuple[RoundStats, ...]
    passes: int
    converged: bool
    stats: Mapping[str, int]


def bound_report(
    options: BoundOptions,
    engine: str,
    input_path: str,
    read: InputFigures,
    graph: GraphDigest,
    outcome: BoundOutcome,
    selection_files: list[dict],
    partitions: int | None = None,
    pipeline_runs: list[dict] | None = None,
) -> BoundReport:
    """The report of a bound (`BoundReport`) from what the engine read and found; `graph` is the digest of
    the valid records' graph (ids and users, not content), which `madp batch` checks DATA against."""
    return BoundReport(
        engine=engine,
        input=input_path,
        parameters=BoundParameters(
            max_contributions=options.max_contributions,
            order=options.order,
            arity_threshold=options.arity_threshold,
            small_run=options.small_run,
            large_run=options.large_run,
            group_sizes=options.group_sizes,
            seed=options.seed,
            max_rounds=options.max_rounds,
            duplicates=options.duplicates,
            capacities=options.capacities,
            id_column=options.columns.id,
            users_column=None if options.columns.users_columns else options.columns.users,
            users_columns=tuple(options.columns.users_columns) or None,
            user_ids=options.columns.user_ids,
            weight_column=options.columns.weight,
            on_invalid=options.on_invalid,
        ),
        contribution_bound=contribution_bound(options),
        ignored_files=tuple(ignored_input_files(input_path)),
        input_rows=read.rows,
        input_records=read.records,
        input_users=read.users,
        rejected=read.rejects.counts(),
        rejected_total=len(read.rejects),
        repeated_users_removed=read.repeated_users_removed,
        graph_digest=graph,
        selected_records=outcome.selected_records,
        distinct_selected=outcome.distinct_selected,
        max_user_contribution=outcome.max_user_contribution,
        rounds=len(outcome.per_round),
        passes=outcome.passes,
        converged=outcome.converged,
        per_round=outcome.per_round,
        histograms=Histograms.from_json(histograms(outcome.stats)),
        selection_files=tuple(FileEntry(**entry) for entry in selection_files),
        partitions=partitions,
        pipeline_runs=None if pipeline_runs is None else tuple(pipeline_runs),
    )


@dataclasses.dataclass(frozen=True)
class RunCounts:
    """The figures of a partitioned engine's run (a Beam pipeline run, a Spark job) that its driver
    reads, from the run's stats by name: 0 where no step counted one (no record, no local finish...)."""

    input_rows: int = 0
    input_records: int = 0
    input_users: int = 0
    repeated_users_removed: int = 0
    certified_dropped_records: int = 0
    built_incidences: int = 0
    max_user_partition_bytes: int = 0
    selected_records: int = 0
    distinct_selected: int = 0
    max_user_contribution: int = 0
    finished_locally_incidences: int | None = None  # None where the run finished nothing locally

    @classmethod
    def of(cls, stats: Mapping[str, int]) -> RunCounts:
        return cls(**{field.name: stats[field.name] for field in dataclasses.fields(cls) if field.name in stats})

    def run_figures(self, iterations: list[dict]) -> dict:
        """What the report's `pipeline_runs` give of a run: its build's counts, `iterations` (each one's
        undecided incidences left, and on Beam the bytes it shuffled) and its local finish."""
        return {
            "certified_dropped_records": self.certified_dropped_records,
            "built_incidences": self.built_incidences,
            "max_user_partition_bytes": self.max_user_partition_bytes,
            "iterations": iterations,
            "finished_locally_incidences": self.finished_locally_incidences,
        }


def partitioned_bound_report(
    options: BoundOptions,
    engine: str,
    input_path: str,
    stats: Mapping[str, int],
    rejects: Rejects,
    control: Control,
    selection_files: list[dict],
    partitions: int,
    runs: list[dict],
) -> BoundReport:
    """The report of a partitioned engine's bound (Beam's pipeline runs, Spark's job) from the stats its
    steps sent, summed by name (`RunCounts`: the last run's), every rejected row and the final control."""
    counts = RunCounts.of(stats)
    return bound_report(
        options,
        engine,
        input_path,
        InputFigures(
            counts.input_rows, counts.input_records, counts.input_users, rejects, counts.repeated_users_removed
        ),
        GraphDigest.from_counts(stats),
        BoundOutcome(
            selected_records=counts.selected_records,
            distinct_selected=counts.distinct_selected,
            max_user_contribution=counts.max_user_contribution,
            per_round=control.per_round,
            passes=control.passes,
            converged=control.converged,
            stats=stats,
        ),
        selection_files,
        partitions=partitions,
        pipeline_runs=runs,
    )
