"""Batch materialization (b-min-sep Poisson sampling, Alg. 3) on Apache Beam, with its I/O:
`BatchPipeline` reads DATA (with its content columns) and the selection's shards, samples them with
the composite `min_sep_sample.MinSepSample` (p calibrated in the graph), and writes the batch files
and the run's summary, all in one pipeline run; `run_beam` is the driver of `madp batch --runner`.

Elements are whole columnar partitions (or the slices of them sent to another partition), keyed by
partition: the runner carries the data. Workers touch files through Beam's `FileSystems` only: the
selection's shards, the batch files, and the run's summary (`BatchSummary`, JSON) that the driver
reads back. The greedy sampler (Alg. 4) is sequential by definition and runs in the driver whatever
the runner.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from apache_beam.options.pipeline_options import PipelineOptions

from madp.beam import files
from madp.beam.batch_join import summary_value
from madp.beam.job_servers import prepare_runner
from madp.beam.min_sep_sample import MinSepSample
from madp.beam.pipeline import (
    NAMESPACE,
    count,
    keeping_input_errors,
    madp_options,
    pipeline_options,
    run,
)
from madp.beam.record_chunks import ReadRecords
from madp.core import batch_files, record_reading, storage
from madp.core import records as rec
from madp.core.batch_steps import WrittenUsers, written_by_partition, written_record_count
from madp.core.errors import InputError
from madp.core.reports import BatchReport
from madp.core.selection import handle_rejects
from madp.engines import batch_local, batch_report, batching
from madp.engines.batch_job import BatchSummary, JobInputs, JobRun, commit, job_inputs, removed_on_failure

log = logging.getLogger("madp.batch")
SUMMARY = "summary.json"
INPUT_ERRORS = "input-errors"


def _write_summary(values: list[tuple[str, object]], path: str, sampled_steps: int) -> str:
    files.write_bytes(path, BatchSummary.of(values, sampled_steps).to_json().encode())
    return path


def _selection_table(path: str, errors_dir: str | None) -> tuple[str, pa.Table]:
    """A selection shard, read through Beam's FileSystems with its page checksums verified: a shard
    that cannot be read (truncated, corrupted, missing) is an InputError naming it."""
    with keeping_input_errors(errors_dir):
        try:
            return path, pq.read_table(pa.BufferReader(files.read_bytes(path)), page_checksum_verification=True)
        except (pa.ArrowInvalid, OSError) as error:
            raise InputError(f"{path}: not a readable Parquet file ({error})") from error


@beam.typehints.with_input_types(tuple[int, batch_files.FileRows], dict)
class _WriteFile(beam.DoFn):
    """Order, truncate, pad and write one batch file (`batch_files.write_batch_file`); written rows go
    on to the statistics (`batch_steps.written_by_partition`)."""

    def __init__(self, output: str, options: batching.BatchOptions, partitions: int):
        self.output, self.options, self.partitions = output, options, partitions

    def process(self, element, content: dict):
        file, rows = element
        shards, steps = self.options.output_shards, self.options.steps
        result = batch_files.write_batch_file(
            batch_files.batch_file_path(self.output, file, shards),
            rows,
            batch_files.step_range(file, steps, shards),
            self.options.max_batch_size,
            content,
            write_whole=files.write_whole,
        )
        count("written_rows", int(result.counts.written.sum()))
        count("truncated_rows", result.counts.truncated)
        count("padding_rows", result.counts.padding)
        yield summary_value("file", (file, result.counts))
        written = written_by_partition(result, self.partitions)
        for users in written.users:
            yield beam.pvalue.TaggedOutput("users", users)
        for records in written.records:
            yield beam.pvalue.TaggedOutput("records", records)


def _participation(element: tuple[int, Iterable[WrittenUsers]]):
    _, pieces = element
    yield "participation", batch_report.participation_of(pieces)


def _written_records(element: tuple[int, Iterable[np.ndarray]]):
    _, keys = element
    yield "written_records", written_record_count(list(keys))


@beam.typehints.with_input_types(tuple[int, batch_files.FileRows])
class WriteBatchFiles(beam.PTransform):
    """(batch file index, FileRows) -> the batch files under `output`, written through Beam's
    FileSystems; the statistics of what was written (per file, participation over users, distinct
    records) as (name, value) summary values. `content` is the content's description (a singleton)."""

    def __init__(
        self,
        output: str,
        options: batching.BatchOptions,
        partitions: int,
        content: beam.PCollection,
    ):
        super().__init__()
        self.output, self.options, self.partitions, self.content = output, options, partitions, content

    def expand(self, rows):
        # users: (user partition, WrittenUsers); records: (record partition, record keys written)
        written = rows | "Write" >> beam.ParDo(
            _WriteFile(self.output, self.options, self.partitions), beam.pvalue.AsSingleton(self.content)
        ).with_outputs("users", "records", "stats", main="unused")
        participation = (
            written.users | "GroupWrittenUsers" >> beam.GroupByKey() | "Participation" >> beam.FlatMap(_participation)
        )
        records = (
            written.records
            | "GroupWrittenRecords" >> beam.GroupByKey()
            | "WrittenRecords" >> beam.FlatMap(_written_records)
        )
        return (written.stats, participation, records) | "WrittenStats" >> beam.Flatten()


class BatchPipeline(beam.PTransform):
    """Read DATA and the selection, sample (MinSepSample), write the batch files (into `staged`, where given,
    else into `output`, which errors name), and write the run's summary (`BatchSummary`, JSON) to `summary`
    through FileSystems. With `bound` (the selection's `batching.bound_graph`), DATA must be the graph it was
    bounded from. With `errors_dir`, an InputError a step meets is kept there for the driver (`pipeline.run`)."""

    def __init__(
        self,
        data_files: list[str],
        selection: list[str],
        data: str,
        output: str,
        content: record_reading.Content,
        options: batching.BatchOptions,
        partitions: int,
        summary: str,
        bound: batching.BoundGraph | None = None,
        errors_dir: str | None = None,
        staged: str | None = None,
    ):
        super().__init__()
        self.data_files, self.selection, self.data, self.output = data_files, selection, data, output
        self.content, self.options, self.partitions, self.summary = content, options, partitions, summary
        self.bound, self.errors_dir, self.staged = bound, errors_dir, staged or output

    def expand(self, pbegin):
        partitions, errors_dir = self.partitions, self.errors_dir
        columns = self.options.columns if self.bound is None else self.bound.columns(self.options.columns)
        # (file index, RecordChunk with content)
        chunks, read_rejects, _ = pbegin | "ReadRecords" >> ReadRecords(
            self.data_files, columns, errors_dir, self.content
        )
        # (shard path, table of id and copies)
        selection = (
            pbegin
            | "ListSelection" >> beam.Create(self.selection)
            | "ReadSelection" >> beam.Map(_selection_table, errors_dir)
        )
        sampled = (chunks, selection) | "MinSepSample" >> MinSepSample(
            self.options, partitions, read_rejects, self.data, self.output, self.bound, errors_dir
        )
        written = sampled.rows | "WriteBatchFiles" >> WriteBatchFiles(
            self.staged, self.options, partitions, sampled.content
        )
        rejects = (
            (read_rejects, sampled.rejects)
            | "AllRejects" >> beam.Flatten()
            | "MergeRejects" >> beam.CombineGlobally(rec.merge_rejects)
            | "NamedRejects" >> beam.Map(lambda r: ("rejects", r))
        )
        content = sampled.content | "NamedContent" >> beam.Map(lambda c: ("content", c))
        return (
            (sampled.stats, written, rejects, content)
            | "Summary" >> beam.Flatten()
            | "CollectSummary" >> beam.combiners.ToList()
            | "WriteSummary" >> beam.Map(_write_summary, self.summary, self.options.sampled_steps)
        )


def _run_pipeline(
    inputs: JobInputs,
    data: str,
    output: str,
    options: batching.BatchOptions,
    partitions: int,
    beam_options: PipelineOptions,
) -> tuple[JobRun, dict]:
    """The pipeline run (`BatchPipeline`) that writes the batch files under the inputs' `work`: what it
    gives the driver, and Beam's counters. A failure removes `work` and leaves OUTPUT as it was."""
    run_dir = storage.join(inputs.work, uuid.uuid4().hex[:12])
    errors_dir, summary_path = storage.join(run_dir, INPUT_ERRORS), storage.join(run_dir, SUMMARY)
    # The pipeline checks what the driver does not read (DATA's columns, its graph, its rows).
    staged = storage.join(run_dir, "batches")
    pipeline = beam.Pipeline(options=beam_options)
    _ = pipeline | "Batch" >> BatchPipeline(
        inputs.data_files,
        inputs.selection,
        data,
        output,
        inputs.content,
        options,
        partitions,
        summary_path,
        inputs.bound,
        errors_dir,
        staged,
    )
    with removed_on_failure(inputs.work):
        counters = run(pipeline, NAMESPACE, errors_dir, output)
        summary = BatchSummary.from_json(files.read_bytes(summary_path).decode())
        if options.on_invalid == "error":
            handle_rejects(summary.rejects, "error", output)
    shards = options.output_shards
    staged_files = [batch_files.batch_file_path(staged, file, shards) for file in range(shards)]
    return JobRun(summary, staged_files, inputs.work), counters


def run_beam(
    selected: str,
    data: str,
    output: str,
    options: batching.BatchOptions,
    beam_args: list[str],
) -> BatchReport:
    """`madp batch --runner <Beam runner>`: one pipeline run (`BatchPipeline`), then the report."""
    beam_options = pipeline_options(beam_args)
    if "rounds_per_pipeline" in beam_options.get_all_options(drop_default=True):
        raise InputError("--rounds-per-pipeline is an option of madp bound, not of madp batch")
    partitions = madp_options(beam_options).partitions
    if options.sampler != "minsep":
        log.warning("--sampler %s runs in this process, not on the Beam runner", options.sampler)
        return batch_local.run_local(
            selected, data, output, options, engine=f"local ({options.sampler} runs in the driver)"
        )
    prepare_runner(beam_options)
    started = time.perf_counter()
    inputs = job_inputs(selected, rec.list_input_files(data), output, options)
    job, counters = _run_pipeline(inputs, data, output, options, partitions, beam_options)
    runner = beam_options.view_as(beam.options.pipeline_options.StandardOptions).runner
    return commit(selected, data, output, options, job, files.move, runner, started, partitions, counters)
