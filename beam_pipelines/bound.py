"""Contribution bounding as an Apache Beam pipeline: the `madp.core.bounding` kernels on partitions.

Every element is a whole columnar partition, never a single record (`bound_build` builds them).
Each round of Alg. 1 is unrolled in the graph as three shuffles of messages (`bound_rounds`).
A pipeline run unrolls a block of rounds; the driver (`run_beam`) chains runs until the algorithm
converges, carrying the partial selection, and starts a new pass over residual capacities for the
with-duplicates variant.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid

import apache_beam as beam
import numpy as np
import pyarrow as pa
from apache_beam.options.pipeline_options import StandardOptions

from beam_pipelines.bound_contributions import BoundContributions
from beam_pipelines.bound_rounds import SideStore, round_stat
from beam_pipelines.pipeline import (
    NAMESPACE,
    keeping_input_errors,
    madp_options,
    merge_rejects,
    merged_records,
    pipeline_options,
    run,
)
from beam_pipelines.record_chunks import ReadRecords, RecordPartitions
from beam_pipelines.store import PartitionStore
from madp.core import records as rec
from madp.core import storage
from madp.core.bounding import Rounds
from madp.core.errors import InputError
from madp.core.graph_digest import GraphDigest
from madp.core.selection import (
    BoundOptions,
    base_report,
    group_sizes,
    handle_rejects,
    histograms,
    prepare_output,
    read_capacities,
    selection_manifest,
    shard_path,
    sorted_selection,
    write_report,
    write_selection_shard,
)

log = logging.getLogger("madp.bound")
WORK_DIR = "_work"


def _write_shard(element, output: str, shards: int):
    shard, tables = element
    table = pa.concat_tables(tables)
    write_selection_shard(
        shard_path(output, shard, shards), sorted_selection(table["id"].combine_chunks(), table["copies"].to_numpy())
    )


def _aggregate_stats(element):
    name, values = element
    return name, (max(values) if name.startswith("max_") else sum(values))


class BoundPipeline(beam.PTransform):
    """Read records, build both sides, run `rounds` unrolled rounds, write selection and state."""

    def __init__(
        self,
        files: list[str],
        output: str,
        options: BoundOptions,
        partitions: int,
        rounds: int,
        run_name: str,
        continues: bool,
        new_pass: bool,
    ):
        super().__init__()
        self.files, self.output, self.options, self.partitions = files, output, options, partitions
        self.rounds, self.run_name, self.continues, self.new_pass = rounds, run_name, continues, new_pass

    def expand(self, pbegin):
        work = storage.join(self.output, WORK_DIR)
        store = SideStore(storage.join(work, self.run_name))
        chunks, read_rejects, read_stats = pbegin | "ReadRecords" >> ReadRecords(
            self.files, self.options.columns, store
        )
        shards, rejects, stats = chunks | "BoundContributions" >> BoundContributions(
            self.options,
            self.partitions,
            self.rounds,
            store,
            storage.join(work, "state"),
            self.continues,
            self.new_pass,
            read_rejects,
            self.output,
        )
        _ = (
            shards
            | "GroupShards" >> beam.GroupByKey()
            | "WriteShards" >> beam.Map(_write_shard, self.output, self.options.output_shards)
        )
        _ = (
            (read_rejects, rejects)
            | "AllRejects" >> beam.Flatten()
            | "MergeRejects" >> beam.CombineGlobally(merge_rejects)
            | "WriteRejects"
            >> beam.Map(lambda r: storage.write_text(storage.join(work, "rejected.jsonl"), r.to_jsonl()))
        )
        return (
            (read_stats, stats)
            | "AllStats" >> beam.Flatten()
            | "GroupStats" >> beam.GroupByKey()
            | "AggregateStats" >> beam.Map(_aggregate_stats)
            | "CollectStats" >> beam.combiners.ToList()
            | "WriteSummary"
            >> beam.Map(
                lambda stats: storage.write_text(
                    storage.join(work, "summary.json"), json.dumps(dict(stats), sort_keys=True)
                )
            )
        )


class GroupSizes(beam.PTransform):
    """--order alternate: records with at most u users and with more, counted as the bounding sees
    them (valid rows, duplicated ids rejected within their id partition), written to `path`."""

    def __init__(self, files: list[str], options: BoundOptions, partitions: int, store: PartitionStore, path: str):
        super().__init__()
        self.files, self.options, self.partitions, self.store, self.path = files, options, partitions, store, path

    def expand(self, pbegin):
        threshold, store, path = self.options.arity_threshold, self.store, self.path
        chunks, _, _ = pbegin | "ReadRecords" >> ReadRecords(self.files, self.options.columns, store)
        return (
            chunks
            | "RecordPartitions" >> RecordPartitions(self.partitions, store)
            | "CountGroups" >> beam.MapTuple(lambda _, paths: _group_sizes(paths, store, threshold))
            | "Total" >> beam.CombineGlobally(lambda sizes: tuple(map(sum, zip(*sizes))) if sizes else (0, 0))
            | "WriteSizes" >> beam.Map(lambda sizes: storage.write_text(path, json.dumps(list(sizes))))
        )


def _group_sizes(paths, store: PartitionStore, threshold: int) -> tuple[int, int]:
    """A record partition's records with at most `threshold` users and with more."""
    with keeping_input_errors(store.directory):  # ids of two types in two files
        return group_sizes(merged_records(store, paths, rec.Rejects()).arity, threshold)


def _count_groups(files: list[str], options: BoundOptions, partitions: int, beam_options, work: str) -> BoundOptions:
    """One pipeline run that counts the two groups of --order alternate (their sizes place the runs)."""
    path = storage.join(work, "group-sizes.json")
    pipeline = beam.Pipeline(options=beam_options)
    store = PartitionStore(storage.join(work, "group-sizes"))
    _ = pipeline | "CountGroups" >> GroupSizes(files, options, partitions, store, path)
    run(pipeline, NAMESPACE, store.directory)
    small, large = json.loads(storage.read_text(path))
    log.info("--order alternate: %d records with at most %d users, %d with more", small, options.arity_threshold, large)
    return dataclasses.replace(options, group_sizes=(small, large))


def run_beam(input_path: str, output: str, options: BoundOptions, beam_args: list[str]) -> dict:
    """`madp bound --runner <Beam runner>`: chain pipeline runs until the algorithm converges."""
    beam_options = pipeline_options(beam_args)
    ours = madp_options(beam_options)
    partitions, rounds_per_pipeline = ours.partitions, ours.rounds_per_pipeline
    started = time.perf_counter()
    files = rec.list_input_files(input_path)
    if options.capacities:
        read_capacities(options.capacities, options.max_contributions)  # fail fast on a bad file
    work = storage.join(output, WORK_DIR)
    storage.clear_directory(work)
    prepare_output(output)
    if options.order == "alternate":
        options = _count_groups(files, options, partitions, beam_options, work)
    rounds = Rounds(options.duplicates, options.max_rounds, started=started)
    run_index, in_pass, new_pass, rejects = 0, False, False, None
    counters: list[dict] = []
    invocation = uuid.uuid4().hex[:12]
    while True:
        block = rounds.room(rounds_per_pipeline)
        first = len(rounds.per_round) + 1
        log.info(
            "pipeline run %d: pass %d, rounds %d-%d",
            run_index + 1,
            rounds.passes + (not in_pass),
            first,
            first + block - 1,
        )
        pipeline = beam.Pipeline(options=beam_options)
        # Unique per invocation: workers cache static arrays by path.
        run_name = f"{invocation}-run-{run_index:04d}"
        _ = pipeline | "Bound" >> BoundPipeline(
            files, output, options, partitions, block, run_name, run_index > 0, new_pass
        )
        try:
            counters.append(run(pipeline, NAMESPACE, storage.join(work, run_name)))
        except InputError:
            prepare_output(output)  # no partial selection outlives an error
            storage.clear_directory(work)
            raise
        summary = json.loads(storage.read_text(storage.join(work, "summary.json")))
        if rejects is None:
            rejects_file = storage.join(work, "rejected.jsonl")
            rejects = rec.Rejects.from_jsonl(
                storage.read_text(rejects_file) if storage.kind(rejects_file) == "file" else ""
            )
            handle_rejects(rejects, options.on_invalid, output)  # under error, the run stopped on them
        eligible = summary.get(round_stat(0, "eligible"), 0)
        if not in_pass and not rounds.start_pass(eligible):
            break
        in_pass = True
        for round_index in range(1, block + 1):
            if eligible == 0:
                break
            eligible = summary[round_stat(round_index, "eligible")]
            rounds.record(summary[round_stat(round_index, "selected")], eligible)
        run_index, new_pass = run_index + 1, False
        if eligible > 0:
            if rounds.room(1):
                continue
            break
        if not rounds.next_pass(eligible):
            break
        in_pass, new_pass = False, True
    for shard in range(options.output_shards):
        if storage.kind(shard_path(output, shard, options.output_shards)) == "missing":
            write_selection_shard(
                shard_path(output, shard, options.output_shards),
                sorted_selection(pa.array([], pa.int64()), np.zeros(0, np.int64)),
            )
    report = base_report(
        options,
        beam_options.view_as(StandardOptions).runner,
        input_path,
        summary.get("input_rows", 0),
        summary.get("input_records", 0),
        summary.get("input_users", 0),
        rejects,
        summary.get("repeated_users_removed", 0),
        GraphDigest.from_counts(summary),
    )
    report.update(
        selected_records=summary.get("selected_records", 0),
        distinct_selected=summary.get("distinct_selected", 0),
        max_user_contribution=summary.get("max_user_contribution", 0),
        rounds=len(rounds.per_round),
        passes=rounds.passes,
        converged=rounds.converged,
        per_round=rounds.per_round,
        partitions=partitions,
        histograms=histograms(summary),
        beam_counters_per_run=counters,
        selection_files=selection_manifest(output, options.output_shards),
        wall_time_s=round(time.perf_counter() - started, 3),
    )
    storage.clear_directory(work)
    write_report(output, report)
    return report
