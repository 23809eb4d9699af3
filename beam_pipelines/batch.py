"""Batch materialization (b-min-sep Poisson sampling, Alg. 3) as Apache Beam pipelines: the
`madp.core.sampling` kernels on record, user and file partitions. Two pipeline runs, because p must be
calibrated before sampling: `batch_prepare` (join, |N(e)| histogram), then the driver calibrates
p, then `batch_sample` (sample, exclude, write the files).

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

from beam_pipelines.batch_prepare import NAMESPACE, PreparePipeline
from beam_pipelines.batch_sample import SamplePipeline, SamplePlan
from beam_pipelines.pipeline import by_kind, madp_options, pipeline_options, run
from beam_pipelines.store import PartitionStore
from madp.core import batch_files, record_reading, sampling, storage
from madp.core import records as rec
from madp.core.errors import InputError
from madp.core.selection import handle_rejects, selection_files, write_report
from madp.engines import batch_local, batch_report, batching

log = logging.getLogger("madp.batch")
WORK_DIR = "_work"


def _merge_described(described: list[dict]) -> dict:
    merged: dict = {}
    for one in described:
        for name, feature in one.items():
            seen = merged.setdefault(name, dict(feature))
            if seen["dtype"] != feature["dtype"]:
                raise InputError(
                    f"content column {name!r} is {seen['dtype']} in some records and {feature['dtype']} in others"
                )
            if seen["shape"] != feature["shape"]:
                seen["shape"] = [None]
    return merged


def run_beam(
    selected: str,
    data: str,
    output: str,
    options: batching.BatchOptions,
    beam_args: list[str],
) -> dict:
    """`madp batch --runner <Beam runner>`: a prepare run, calibration of p in the driver, a sample run."""
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
    work = storage.join(output, WORK_DIR)
    storage.clear_directory(work)
    batch_report.prepare_output(output)
    store = PartitionStore(storage.join(work, uuid.uuid4().hex[:12]))

    counters = []
    pipeline = beam.Pipeline(options=beam_options)
    _ = pipeline | "Prepare" >> PreparePipeline(data_files, selection, data, content, options, partitions, store)
    try:
        counters.append(run(pipeline, NAMESPACE, store.directory))
        prepared = by_kind(store.read_arrays(storage.join(store.directory, "prepare-summary.store")))
        rejects = prepared.get("rejects", [rec.Rejects()])[0]
        handle_rejects(rejects, options.on_invalid, output)
        described = _merge_described(prepared.get("described", []))
        histogram = prepared.get("histogram", [{}])[0]
        sizes = np.array(sorted(histogram), dtype=np.int64)
        counts = np.array([histogram[s] for s in sizes.tolist()], dtype=np.int64)
        probability = sampling.calibrate_probability(options.batch_size, sizes, counts, options.min_sep)
        log.info("calibrated p = %.6g for an expected batch size of %g", probability, options.batch_size)
        plan = SamplePlan(
            probability=probability,
            total_steps=options.steps + options.warm_up_steps,
            warm_up=options.warm_up_steps,
            steps=options.steps,
            min_sep=options.min_sep,
            files=options.output_shards,
            max_batch_size=options.max_batch_size,
            output=output,
            shapes=batch_files.content_shapes(described),
        )
        partition_paths = dict(prepared.get("partition", []))
        pipeline = beam.Pipeline(options=beam_options)
        _ = pipeline | "Sample" >> SamplePipeline(plan, partition_paths, partitions, store)
        counters.append(run(pipeline, NAMESPACE, store.directory))
        summary = by_kind(store.read_arrays(storage.join(store.directory, "sample-summary.store")))
    except InputError:
        batch_report.prepare_output(output)  # no partial batches outlive an error
        storage.clear_directory(work)
        raise
    id_type = prepared.get("id_type", [pa.int64()])[0]
    batch_files.write_schema(output, batching.schema(id_type, described, options))
    records = sum(prepared.get("records", []))
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
        sampled_sizes=np.sum(summary.get("sampled_sizes", [np.zeros(plan.total_steps, np.int64)]), axis=0),
        files=files,
        records_never_written=records - sum(summary.get("written_records", [])),
        participation=batch_report.merge_participation_stats(summary.get("participation", [])),
        rejects=rejects,
        content_columns=list(content),
        started=started,
    )
    result.update(partitions=partitions, beam_counters_per_run=counters)
    storage.clear_directory(work)
    write_report(output, result)
    return result
