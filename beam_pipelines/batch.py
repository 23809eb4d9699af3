"""Batch materialization (b-min-sep Poisson sampling, Alg. 3) on Apache Beam, with its I/O:
`BatchPipeline` reads DATA (with its content columns) and the selection's shards, samples them with
the composite `min_sep_sample.MinSepSample` (p calibrated in the graph), and writes the batch files
and the run's summary, all in one pipeline run; `run_beam` is the driver of `madp batch --runner`.

Elements are whole columnar partitions; arrays go through a `PartitionStore` under OUTPUT/_work/
and only handles travel through the graph. The greedy sampler (Alg. 4) is sequential by
definition and runs in the driver whatever the runner.
"""

from __future__ import annotations

import logging
import time
import uuid

import apache_beam as beam
import numpy as np
import pyarrow as pa

from beam_pipelines.batch_join import record_partition_of, summary_value, user_partition_of
from beam_pipelines.min_sep_sample import MinSepSample, histogram_arrays
from beam_pipelines.pipeline import (
    NAMESPACE,
    by_kind,
    count,
    keeping_input_errors,
    madp_options,
    merge_rejects,
    pipeline_options,
    run,
)
from beam_pipelines.record_chunks import ReadRecords
from beam_pipelines.store import PartitionStore, stack
from madp.core import batch_files, record_reading, sampling, storage
from madp.core import records as rec
from madp.core.errors import InputError
from madp.core.selection import handle_rejects, selection_files, write_report
from madp.engines import batch_local, batch_report, batching

log = logging.getLogger("madp.batch")
WORK_DIR = "_work"
SUMMARY = "summary.store"


def _selection_table(path: str, store: PartitionStore) -> tuple[str, pa.Table]:
    with keeping_input_errors(store.directory):  # a shard that cannot be read
        return path, storage.read_parquet(path)


@beam.typehints.with_input_types(tuple[int, batch_files.FileRows], dict)
class _WriteFile(beam.DoFn):
    """Order, truncate, pad and write one batch file; written rows go on to the statistics."""

    def __init__(self, output: str, options: batching.BatchOptions, partitions: int, store: PartitionStore):
        self.output, self.options, self.partitions, self.store = output, options, partitions, store

    def process(self, element, content: dict):
        file, rows = element
        files, steps = self.options.output_shards, self.options.steps
        result = batch_files.write_batch_file(
            batch_files.batch_file_path(self.output, file, files),
            rows,
            batch_files.step_range(file, steps, files),
            self.options.max_batch_size,
            batch_files.content_shapes(content),
        )
        count("written_rows", int(result["written"].sum()))
        count("truncated_rows", result["truncated"])
        count("padding_rows", result["padding"])
        yield summary_value("file", (file, {k: result[k] for k in ("written", "truncated", "padding")}))
        users, user_steps, records = result["user_hashes"], result["user_steps"], result["record_keys"]
        for user_part, handle in self.store.write_split(
            f"written-users-{file:05d}.store",
            user_partition_of(users, self.partitions),
            lambda mask: (users[mask], user_steps[mask]),
        ):
            yield beam.pvalue.TaggedOutput("users", (user_part, handle))
        for record_part, handle in self.store.write_split(
            f"written-records-{file:05d}.store",
            record_partition_of(records, self.partitions),
            lambda mask: records[mask],
        ):
            yield beam.pvalue.TaggedOutput("records", (record_part, handle))


def _participation(element, store: PartitionStore):
    _, handles = element
    pieces = store.gather(handles)
    yield "participation", batch_report.participation_stats(stack(pieces, 0), stack(pieces, 1))


def _written_records(element, store: PartitionStore):
    _, handles = element
    yield "written_records", len(np.unique(np.concatenate(store.gather(handles))))


@beam.typehints.with_input_types(tuple[int, batch_files.FileRows])
class WriteBatchFiles(beam.PTransform):
    """(batch file index, FileRows) -> the batch files under `output`; the statistics of what was
    written (per file, participation over users, distinct records) as summary values."""

    def __init__(
        self,
        output: str,
        options: batching.BatchOptions,
        partitions: int,
        store: PartitionStore,
        content: beam.PCollection,
    ):
        super().__init__()
        self.output, self.options, self.partitions = output, options, partitions
        self.store, self.content = store, content

    def expand(self, rows):
        store = self.store
        written = rows | "Write" >> beam.ParDo(
            _WriteFile(self.output, self.options, self.partitions, store), beam.pvalue.AsSingleton(self.content)
        ).with_outputs("users", "records", "stats", main="unused")
        participation = (
            written.users
            | "GroupWrittenUsers" >> beam.GroupByKey()
            | "Participation" >> beam.FlatMap(_participation, store)
        )
        records = (
            written.records
            | "GroupWrittenRecords" >> beam.GroupByKey()
            | "WrittenRecords" >> beam.FlatMap(_written_records, store)
        )
        return (written.stats, participation, records) | "WrittenStats" >> beam.Flatten()


class BatchPipeline(beam.PTransform):
    """Read DATA and the selection, sample (MinSepSample), write the batch files, store the summary.
    With `bound` (the selection's `batching.bound_graph`), DATA must be the graph it was bounded from."""

    def __init__(
        self,
        data_files: list[str],
        selection: list[str],
        data: str,
        output: str,
        content: tuple[str, ...],
        options: batching.BatchOptions,
        partitions: int,
        store: PartitionStore,
        bound: batching.BoundGraph | None = None,
    ):
        super().__init__()
        self.data_files, self.selection, self.data, self.output = data_files, selection, data, output
        self.content, self.options, self.partitions, self.store = content, options, partitions, store
        self.bound = bound

    def expand(self, pbegin):
        store, partitions = self.store, self.partitions
        columns = self.options.columns if self.bound is None else self.bound.columns(self.options.columns)
        chunks, read_rejects, _ = pbegin | "ReadRecords" >> ReadRecords(self.data_files, columns, store, self.content)
        selection = (
            pbegin
            | "ListSelection" >> beam.Create(self.selection)
            | "ReadSelection" >> beam.Map(_selection_table, store)
        )
        sampled = (chunks, selection) | "MinSepSample" >> MinSepSample(
            self.options, partitions, store, read_rejects, self.data, self.output, self.bound
        )
        written = sampled.rows | "WriteBatchFiles" >> WriteBatchFiles(
            self.output, self.options, partitions, store, sampled.content
        )
        rejects = (
            (read_rejects, sampled.rejects)
            | "AllRejects" >> beam.Flatten()
            | "MergeRejects" >> beam.CombineGlobally(merge_rejects)
            | "NamedRejects" >> beam.Map(lambda r: ("rejects", r))
        )
        content = sampled.content | "NamedContent" >> beam.Map(lambda c: ("content", c))
        return (
            (sampled.stats, written, rejects, content)
            | "Summary" >> beam.Flatten()
            | "CollectSummary" >> beam.combiners.ToList()
            | "WriteSummary" >> beam.Map(lambda items: store.write_arrays(SUMMARY, items))
        )


def run_beam(
    selected: str,
    data: str,
    output: str,
    options: batching.BatchOptions,
    beam_args: list[str],
) -> dict:
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
    started = time.perf_counter()
    data_files = rec.list_input_files(data)
    content = (
        options.content_columns
        if options.content_columns is not None
        else record_reading.content_columns(data_files[0], options.columns)
    )
    selection = selection_files(selected)
    bound = batching.bound_graph(selected)  # DATA's graph is checked against it in the pipeline
    work = storage.join(output, WORK_DIR)
    storage.clear_directory(work)
    batch_report.prepare_output(output)
    store = PartitionStore(storage.join(work, uuid.uuid4().hex[:12]))
    pipeline = beam.Pipeline(options=beam_options)
    _ = pipeline | "Batch" >> BatchPipeline(
        data_files, selection, data, output, content, options, partitions, store, bound
    )
    try:
        counters = run(pipeline, NAMESPACE, store.directory)
        summary = by_kind(store.read_arrays(storage.join(store.directory, SUMMARY)))
        rejects = summary["rejects"][0]
        handle_rejects(rejects, options.on_invalid, output)
    except InputError:
        batch_report.prepare_output(output)  # no batch file outlives an error
        storage.clear_directory(work)
        raise
    probability = summary["probability"][0]
    log.info("calibrated p = %.6g for an expected batch size of %g", probability, options.batch_size)
    sizes, counts = histogram_arrays(summary["histogram"][0])
    described = summary["content"][0]
    batch_files.write_schema(output, batching.schema(summary["id_type"][0], described, options))
    records = sum(summary["records"])
    files = [f for _, f in sorted(summary.get("file", []), key=lambda item: item[0])]
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
        beam_options.view_as(beam.options.pipeline_options.StandardOptions).runner,
        selected,
        data,
        output,
        sampled=sampled,
        units=int(counts.sum()),
        records=records,
        sampled_sizes=np.sum(summary.get("sampled_sizes", [np.zeros(options.sampled_steps, np.int64)]), axis=0),
        files=files,
        records_never_written=records - sum(summary.get("written_records", [])),
        participation=batch_report.merge_participation_stats(summary.get("participation", [])),
        rejects=rejects,
        content_columns=list(content),
        started=started,
    )
    result.update(partitions=partitions, beam_counters_per_run=[counters])
    storage.clear_directory(work)
    write_report(output, result)
    return result
