"""The driver's side of b-min-sep batching on an engine that moves the partitions (Beam's
`madp.beam.batch`, Spark's `madp.spark.batch`): the inputs it names without reading any data, the
summary the job gives back (`BatchSummary`), and the outputs committed once the job has passed.

The job writes the batch files under OUTPUT/_work/ (`JobInputs.work`); they take the earlier batches'
place only once it has passed, so a failed run (a check, a full disk, Ctrl-C) leaves the earlier
batches, made with a secret key that is gone, as they were.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

import numpy as np
import pyarrow as pa

from madp.core import batch_files, record_reading, sampling, storage
from madp.core import records as rec
from madp.core.batch_steps import histogram_arrays
from madp.core.columnar import Columnar
from madp.core.reports import BatchReport, Participation, SparkFaults
from madp.core.selection import WORK_DIR, handle_rejects, selection_files, write_report
from madp.engines import batch_report, batching

log = logging.getLogger("madp.batch")


@dataclasses.dataclass(frozen=True)
class BatchSummary(Columnar):
    """What a batching job tells its driver for the report. Beam's travels as JSON, never pickle: the
    file lies under OUTPUT, and a pickle planted there would run code in the driver."""

    histogram: dict[int, int]  # units by |N(e)|
    probability: float  # p, calibrated
    content: dict[str, batch_files.Feature]  # the content columns' description, by name
    id_type: str  # the records' ids, as Arrow names their type ("int64", "string")
    records: int  # selected records joined
    files: list[batch_files.FileCounts]  # per batch file, in order
    sampled_sizes: np.ndarray  # realized size of every sampled step (warm-up included), before truncation
    participation: Participation  # of the written rows' users (`batch_report.participation_stats`)
    written_records: int  # distinct records in some batch file
    rejects: rec.Rejects  # every row rejected: in reading, as a duplicated id, or for its content (skip)

    @classmethod
    def of(cls, values: Iterable[tuple[str, object]], sampled_steps: int) -> BatchSummary:
        """The summary of a job's (name, value) summary values."""
        named: dict[str, list] = {}
        for name, value in values:
            named.setdefault(name, []).append(value)
        return cls(
            histogram=named["histogram"][0],
            probability=named["probability"][0],
            content=named["content"][0],
            id_type=str(named["id_type"][0]),
            records=sum(named.get("records", [])),
            files=[counts for _, counts in sorted(named.get("file", []), key=lambda item: item[0])],
            sampled_sizes=np.sum(named.get("sampled_sizes", [np.zeros(sampled_steps, np.int64)]), axis=0),
            participation=batch_report.merge_participation_stats(named.get("participation", [])),
            written_records=sum(named.get("written_records", [])),
            rejects=named["rejects"][0],
        )

    def to_json(self) -> str:
        return json.dumps(
            {
                "histogram": [[int(size), int(units)] for size, units in self.histogram.items()],
                "probability": self.probability,
                "content": {name: feature.to_json() for name, feature in self.content.items()},
                "id_type": self.id_type,
                "records": self.records,
                "files": [counts.to_json() for counts in self.files],
                "sampled_sizes": self.sampled_sizes.tolist(),
                "participation": self.participation.to_json(),
                "written_records": self.written_records,
                "rejects": self.rejects.to_jsonl(),
            }
        )

    @classmethod
    def from_json(cls, text: str) -> BatchSummary:
        fields = json.loads(text)
        return cls(
            histogram={int(size): int(units) for size, units in fields["histogram"]},
            probability=float(fields["probability"]),
            content={name: batch_files.Feature.from_json(name, feature) for name, feature in fields["content"].items()},
            id_type=fields["id_type"],
            records=int(fields["records"]),
            files=[batch_files.FileCounts.from_json(counts) for counts in fields["files"]],
            sampled_sizes=np.array(fields["sampled_sizes"], dtype=np.int64),
            participation=Participation.from_json(fields["participation"]),
            written_records=int(fields["written_records"]),
            rejects=rec.Rejects.from_jsonl(fields["rejects"]),
        )


class JobInputs(NamedTuple):
    """What the driver names for the job, having read no data: the job checks DATA's columns, its
    graph (against `bound`) and its rows."""

    data_files: list[str]
    content: record_reading.Content  # the columns named, or every other column the job's reads find
    selection: list[str]  # the selection's shards
    bound: batching.BoundGraph  # DATA's graph is checked against it in the job
    work: str  # OUTPUT/_work: where the job writes, emptied


def job_inputs(selected: str, data_files: list[str], output: str, options: batching.BatchOptions) -> JobInputs:
    """The job's inputs (DATA's files, none for a DataFrame), once OUTPUT may be replaced
    (`batch_report.refuse_losing_trainings`, before anything of it is deleted)."""
    content = record_reading.OTHER_COLUMNS if options.content_columns is None else options.content_columns
    selection = selection_files(selected)
    bound = batching.bound_graph(selected)
    batch_report.refuse_losing_trainings(output)
    work = storage.join(output, WORK_DIR)
    storage.remove_tree(work)
    return JobInputs(data_files, content, selection, bound, work)


@contextlib.contextmanager
def removed_on_failure(work: str) -> Iterator[None]:
    """Around the job: a failure (a failed check, a full disk, Ctrl-C) removes `work`, with the batch
    files staged there, and leaves the earlier batches as they were."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(OSError):
            storage.remove_tree(work)
        raise


class JobRun(NamedTuple):
    """What a passed job gives its driver: its summary and the file holding each batch file's bytes, in order."""

    summary: BatchSummary
    staged: list[str]
    work: str  # removed once the outputs are committed


def commit(
    selected: str,
    data: str,
    output: str,
    options: batching.BatchOptions,
    run: JobRun,
    move: Callable[[str, str], None],
    engine: str,
    started: float,
    partitions: int,
    counters: dict | None = None,
    faults: SparkFaults | None = None,
) -> BatchReport:
    """The passed job's batch files in place of the earlier batches (each staged file `move`d to its
    name), the rejects, schema.json and report.json written (with Beam's `counters`, or what Spark's
    job recovered from, `faults`); `work` removed."""
    summary = run.summary
    batch_report.prepare_output(output)
    shards = options.output_shards
    for file, staged in enumerate(run.staged):
        move(staged, batch_files.batch_file_path(output, file, shards))
    handle_rejects(summary.rejects, options.on_invalid, output)  # skipped rows: OUTPUT/rejected/
    probability = summary.probability
    log.info("calibrated p = %.6g for an expected batch size of %g", probability, options.batch_size)
    sizes, counts = histogram_arrays(summary.histogram)
    batch_files.write_schema(output, batching.schema(pa.type_for_alias(summary.id_type), summary.content, options))
    sampled = batch_report.Sampled(
        np.zeros(0, np.int64),
        np.zeros(0, np.uint64),
        np.zeros(0, np.int64),
        options.min_sep,
        probability,
        sampling.expected_batch_size(probability, sizes, counts, options.min_sep),
    )
    result = batch_report.report(
        options,
        engine,
        selected,
        data,
        output,
        sampled=sampled,
        units=int(counts.sum()),
        records=summary.records,
        sampled_sizes=summary.sampled_sizes,
        files=summary.files,
        records_never_written=summary.records - summary.written_records,
        participation=summary.participation,
        rejects=summary.rejects,
        content_columns=list(summary.content),
        started=started,
        partitions=partitions,
        beam_counters=counters,
        spark_faults=faults,
    )
    storage.remove_tree(run.work)
    write_report(output, result)
    return result
