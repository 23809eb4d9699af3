"""What `madp batch` reports, the same from both engines: batch sizes, participation statistics
per user, rejects and the files written; and the batch output directory's own files."""

from __future__ import annotations

import dataclasses
import json
import os
import posixpath
import time
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from madp.core import records as rec
from madp.core import storage
from madp.core.batch_files import SCHEMA_FILE, TRAININGS_FILE, FileCounts, batch_file_path
from madp.core.batch_steps import WrittenUsers
from madp.core.errors import InputError
from madp.core.reports import (
    BatchParameters,
    BatchReport,
    BoundRecord,
    FileEntry,
    Participation,
    SizeSummary,
    SparkFaults,
)
from madp.core.selection import REJECTED_DIR, REPORT_FILE, read_bound_report
from madp.engines.batching import BatchOptions


@dataclasses.dataclass
class Sampled:
    """Rows of a sampler: record index, unit key and step (warm-up included) of each."""

    record: np.ndarray
    keys: np.ndarray
    step: np.ndarray
    min_sep: int
    probability: float | None = None
    expected_batch_size: float | None = None
    min_sep_search: list | None = None
    sampled_users: np.ndarray | None = None  # users sampler: users per step, what --batch-size targets


def participation_stats(user_hashes_: np.ndarray, steps: np.ndarray) -> Participation:
    """Per-user participations of written rows; exact when all of a user's rows are passed together."""
    if len(steps) == 0:
        return Participation(
            users=0,
            max_participations=0,
            max_rows=0,
            min_gap=None,
            user_rows_sharing_a_step=0,
            gap_histogram={},
        )
    order = np.lexsort((steps, user_hashes_))
    user, step = user_hashes_[order], steps[order]
    new_user = np.concatenate([[True], user[1:] != user[:-1]])
    new_pair = new_user | np.concatenate([[True], step[1:] != step[:-1]])
    user_index = np.cumsum(new_user) - 1
    participations = np.bincount(user_index[new_pair])
    distinct_user, distinct_step = user[new_pair], step[new_pair]
    same = distinct_user[1:] == distinct_user[:-1]
    gaps = (distinct_step[1:] - distinct_step[:-1])[same]
    return Participation(
        users=int(new_user.sum()),
        max_participations=int(participations.max()),
        max_rows=int(np.bincount(user_index).max()),
        min_gap=int(gaps.min()) if len(gaps) else None,
        user_rows_sharing_a_step=int((~new_pair).sum()),
        gap_histogram=value_counts(gaps),
    )


def participation_of(pieces: Iterable[WrittenUsers]) -> Participation:
    """`participation_stats` of a user partition's written (user, step) pairs, sent from every batch
    file (`batch_steps.written_by_partition`): exact, as all of each user's pairs are there."""
    pieces = list(pieces)
    return participation_stats(np.concatenate([p.users for p in pieces]), np.concatenate([p.steps for p in pieces]))


def value_counts(values: np.ndarray) -> dict[str, int]:
    """{value: count} with string keys (JSON objects), for histograms that merge by summing."""
    found, counts = np.unique(np.asarray(values, dtype=np.int64), return_counts=True)
    return {str(int(v)): int(c) for v, c in zip(found, counts)}


def merge_counts(histograms: Iterable[Mapping[Any, int]]) -> dict[Any, int]:
    """Summed histograms, by increasing value; the values are integers or their strings (JSON keys)."""
    merged: dict[Any, int] = {}
    for histogram in histograms:
        for value, count in histogram.items():
            merged[value] = merged.get(value, 0) + count
    return dict(sorted(merged.items(), key=lambda item: int(item[0])))


def merge_participation_stats(parts: list[Participation]) -> Participation:
    """The participation of users that each appear in one part only (the parts of user partitions)."""
    gaps = [p.min_gap for p in parts if p.min_gap is not None]
    return Participation(
        users=sum(p.users for p in parts),
        max_participations=max((p.max_participations for p in parts), default=0),
        max_rows=max((p.max_rows for p in parts), default=0),
        min_gap=min(gaps) if gaps else None,
        user_rows_sharing_a_step=sum(p.user_rows_sharing_a_step for p in parts),
        gap_histogram=merge_counts(p.gap_histogram for p in parts),
    )


def _size_summary(sizes: np.ndarray) -> SizeSummary:
    return SizeSummary(
        mean=round(float(sizes.mean()), 4) if len(sizes) else 0.0,
        std=round(float(sizes.std()), 4) if len(sizes) else 0.0,
        min=int(sizes.min()) if len(sizes) else 0,
        max=int(sizes.max()) if len(sizes) else 0,
        per_step=tuple(sizes.tolist()),
    )


def report(
    options: BatchOptions,
    engine: str,
    selected: str,
    data: str,
    output: str,
    *,
    sampled: Sampled,
    units: int,
    records: int,
    sampled_sizes: np.ndarray,
    files: list[FileCounts],
    records_never_written: int,
    participation: Participation,
    rejects: rec.Rejects,
    content_columns: list[str],
    started: float,
    partitions: int | None = None,
    beam_counters: dict | None = None,
    spark_faults: SparkFaults | None = None,
) -> BatchReport:
    """The report both engines write; `sampled_sizes` (per step, before truncation) includes warm-up;
    `participation` as `participation_stats` gives it; Beam's `partitions` and pipeline counters, or what
    Spark's job recovered from."""
    warm_up = options.warm_up_steps
    realized = sampled_sizes[warm_up:]
    written = np.concatenate([f.written for f in files])
    target = realized if sampled.sampled_users is None else sampled.sampled_users  # what --batch-size counts
    search = sampled.min_sep_search
    return BatchReport(
        engine=engine,
        selected=_absolute(selected),
        data=_absolute(data),
        sampler=options.sampler,
        bound=BoundRecord.of(read_bound_report(selected)),
        parameters=BatchParameters(
            steps=options.steps,
            batch_size=options.batch_size,
            min_sep=sampled.min_sep,
            batch_size_counts="users" if options.sampler == "users" else "records",
            warm_up=warm_up,
            max_batch_size=options.max_batch_size,
            seed=options.seed,
            output_shards=options.output_shards,
            on_invalid=options.on_invalid,
            content_columns=tuple(content_columns),
        ),
        sampling=options.sampling,
        sampling_probability=sampled.probability,
        expected_batch_size=sampled.expected_batch_size,
        steps=options.steps,
        records=records,
        units=units,
        batch_sizes=_size_summary(realized),
        relative_error_to_target=round(float(target.mean() / options.batch_size - 1.0), 6),
        written_batch_sizes=_size_summary(written),  # per step: the rows a private step checks it is given
        warm_up_batch_sizes=tuple(sampled_sizes[:warm_up].tolist()),
        truncated_rows=sum(f.truncated for f in files),
        padding_rows=sum(f.padding for f in files),
        records_never_written=records_never_written,
        participation=participation,
        rejected=rejects.counts(),
        rejected_total=len(rejects),
        files=tuple(
            FileEntry(**entry)
            for entry in storage.manifest(
                [batch_file_path(output, file, options.output_shards) for file in range(options.output_shards)]
            )
        ),
        wall_time_s=round(time.perf_counter() - started, 3),
        users_per_step=None if sampled.sampled_users is None else _size_summary(sampled.sampled_users),
        min_sep_search=None if search is None else tuple(search),
        k=None if search is None else participation.max_participations,
        partitions=partitions,
        beam_counters_per_run=None if beam_counters is None else (beam_counters,),
        spark_faults=spark_faults,
    )


def _absolute(path: str) -> str:
    """Local paths absolute, so that later stages (the trainer) find the inputs from anywhere; a DataFrame
    input is named as it is (`records.DATAFRAME`)."""
    return path if "://" in path or path == rec.DATAFRAME else os.path.abspath(path)


def prepare_output(output: str) -> None:
    """Remove an earlier run's batch files, schema, report and rejects (and only those); refused where
    that would lose private trainings on its batches (`refuse_losing_trainings`)."""
    refuse_losing_trainings(output)
    for path in storage.list_files(output, recursive=False) if storage.kind(output) == "directory" else []:
        if posixpath.basename(path).startswith("batches-") and path.endswith(".tfrecord"):
            storage.remove_file(path)
    for name in (SCHEMA_FILE, REPORT_FILE, TRAININGS_FILE):  # new batches: no training has used them yet
        storage.remove_file(storage.join(output, name))
    storage.remove_tree(storage.join(output, REJECTED_DIR))  # a run writes it only where it skips rows


def refuse_losing_trainings(output: str) -> None:
    """Refuse a new batching into OUTPUT that would lose trainings on its batches. The checkpoint of an
    interrupted training on them resumes only on them (`stranded_checkpoints`: the trainings ledger names
    it). A batch output's own trainings ledger (madp kept it there before the ledger moved beside the
    selection) names private trainings on its batches, which later trainings compose with; its entries
    join the selection's ledger at the next private training on those batches, and a new batching into the
    output before that would delete the only record of them."""
    if storage.kind(storage.join(output, REPORT_FILE)) == "file":  # finished batches, which a training may use
        from madp.training.ledger import refuse_stranding, stranded_checkpoints  # no TensorFlow

        refuse_stranding(
            stranded_checkpoints(output),
            f"a new batching into {output} would replace its batches",
            "Resume it first (its madp train command again, with --resume), or batch into another OUTPUT",
        )
    own = storage.join(output, TRAININGS_FILE)
    if storage.kind(own) != "file":
        return
    report = storage.join(output, REPORT_FILE)
    selected = json.loads(storage.read_text(report)).get("selected") if storage.kind(report) == "file" else None
    kept = _training_ids(storage.join(selected, TRAININGS_FILE)) if isinstance(selected, str) else set()
    if _training_ids(own) - kept:
        raise InputError(
            f"{own} records private trainings on the batches in {output}, which the trainings ledger of their "
            f"selection ({selected}) does not hold yet: a new batching there would delete that record, and "
            f"later trainings would no longer compose with them; batch into another OUTPUT"
        )


def _training_ids(ledger: str) -> set[str | None]:
    """The trainings a ledger file names (none where there is no file)."""
    from madp.training.ledger import read_entries  # no TensorFlow

    return {entry.training for entry in read_entries(ledger)}
