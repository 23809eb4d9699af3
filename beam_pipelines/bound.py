"""Contribution bounding as an Apache Beam pipeline, with its I/O: `BoundPipeline` reads the records,
bounds them with the composite `bound_contributions.BoundContributions` and writes the selection
shards, the rejected rows and the run's summary through Beam's FileSystems; `run_beam` is the driver
of `madp bound --runner`. A typical graph finishes in one pipeline run (the rounds in the graph, then
the local finish once little is left); otherwise the driver runs it again from where it stopped.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid
from collections.abc import Mapping
from typing import Any, NamedTuple

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions

from madp.beam import files
from madp.beam.bound_contributions import BoundContributions
from madp.beam.job_servers import prepare_runner
from madp.beam.pipeline import (
    NAMESPACE,
    MadpPipelineOptions,
    keeping_input_errors,
    madp_options,
    pipeline_options,
    run,
)
from madp.beam.record_chunks import ReadRecords, RecordPartitions
from madp.core import record_reading, storage
from madp.core import records as rec
from madp.core.bound_steps import round_stat
from madp.core.bounding import DONE, Capacities, Control
from madp.core.errors import InputError
from madp.core.reports import BoundReport
from madp.core.selection import (
    WORK_DIR,
    BoundOptions,
    RunCounts,
    group_sizes,
    handle_rejects,
    partitioned_bound_report,
    prepare_output,
    read_capacities,
    selection_manifest,
    selection_shard,
    shard_path,
    stat_total,
    write_missing_shards,
    write_report,
)

log = logging.getLogger("madp.bound")
SUMMARY, REJECTED, CONTROL = "summary.json", "rejected.jsonl", "control"


def _write_shard(element, output: str, shards: int):
    shard, tables = element
    selection = selection_shard(tables)
    files.write_whole(shard_path(output, shard, shards), lambda handle: storage.parquet_to(handle, selection))


@dataclasses.dataclass(frozen=True)
class PipelineRunSummary:
    """What a pipeline run of the bound leaves its driver (SUMMARY under the run's folder): its stats,
    summed by name (the `max_` ones at their maximum), and the algorithm's control after it. `stats`
    holds every one (per-round figures, histograms and the graph digest's parts too), `counts` those
    the driver reads by name."""

    counts: RunCounts
    stats: Mapping[str, int]
    control: Control

    @classmethod
    def of(cls, stats: Mapping[str, int], control: Control) -> PipelineRunSummary:
        return cls(RunCounts.of(stats), dict(stats), control)

    def to_json(self) -> dict[str, Any]:
        return {**self.stats, CONTROL: self.control.to_json()}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PipelineRunSummary:
        return cls.of(
            {name: value for name, value in data.items() if name != CONTROL}, Control.from_json(data[CONTROL])
        )

    def iterations(self, rounds: int) -> list[dict]:
        """What each iteration of the run carried: the undecided incidences left after it (after the
        first saturation, or as built where none runs), and the bytes of arrays its steps sent
        through shuffles (state and messages)."""
        active = {0: self.counts.built_incidences} | {
            index: self.stats[round_stat(index, "active_incidences")]
            for index in range(rounds + 1)
            if round_stat(index, "active_incidences") in self.stats
        }
        return [
            {
                "iteration": index,
                "active_incidences": left,
                "shuffled_bytes": self.stats.get(round_stat(index, "shuffled_bytes"), 0),
            }
            for index, left in sorted(active.items())
        ]


def _write_summary(stats: list, control: Control, run_dir: str) -> None:
    summary = PipelineRunSummary.of(dict(stats), control).to_json()
    files.write_bytes(files.FileSystems.join(run_dir, SUMMARY), json.dumps(summary, sort_keys=True).encode())


def _aggregate_stats(element):
    name, values = element
    return name, stat_total(name, values)


class BoundPipeline(beam.PTransform):
    """Read records, bound them (from `control`, continuing from `resume_from` when set), write the
    selection shards, the rejected rows and the summary (counts and the final Control) under `run_dir`."""

    def __init__(
        self,
        input_files: list[str],
        output: str,
        options: BoundOptions,
        partitions: int,
        rounds: int,
        local_finish_incidences: int,
        capacities: Capacities | None,
        control: Control,
        run_dir: str,
        resume_from: str | None,
    ):
        super().__init__()
        self.input_files, self.output, self.options, self.partitions = input_files, output, options, partitions
        self.rounds, self.threshold, self.capacities = rounds, local_finish_incidences, capacities
        self.control, self.run_dir, self.resume_from = control, run_dir, resume_from

    def expand(self, pbegin):
        run_dir, errors = self.run_dir, files.FileSystems.join(self.run_dir, "input-errors")
        chunks, read_rejects, read_stats = pbegin | "ReadRecords" >> ReadRecords(
            self.input_files, self.options.columns, errors
        )
        bound = chunks | "BoundContributions" >> BoundContributions(
            self.options,
            self.partitions,
            self.rounds,
            self.threshold,
            self.capacities,
            self.control,
            self.resume_from,
            files.FileSystems.join(run_dir, "state"),
            read_rejects,
            self.output,
            errors,
        )
        _ = (
            bound.shards
            | "GroupShards" >> beam.GroupByKey()
            | "WriteShards" >> beam.Map(_write_shard, self.output, beam.pvalue.AsSingleton(bound.shard_count))
        )
        _ = (
            (read_rejects, bound.rejects)
            | "AllRejects" >> beam.Flatten()
            | "MergeRejects" >> beam.CombineGlobally(rec.merge_rejects)
            | "WriteRejects"
            >> beam.Map(lambda r: files.write_bytes(files.FileSystems.join(run_dir, REJECTED), r.to_jsonl().encode()))
        )
        return (
            (read_stats, bound.stats)
            | "AllStats" >> beam.Flatten()
            | "GroupStats" >> beam.GroupByKey()
            | "AggregateStats" >> beam.Map(_aggregate_stats)
            | "CollectStats" >> beam.combiners.ToList()
            | "WriteSummary" >> beam.Map(_write_summary, beam.pvalue.AsSingleton(bound.control), run_dir)
        )


class GroupSizes(beam.PTransform):
    """--order alternate: records with at most u users and with more, counted as the bounding sees
    them (valid rows, duplicated ids rejected within their id partition), written to `path`."""

    def __init__(self, input_files: list[str], options: BoundOptions, partitions: int, errors_dir: str, path: str):
        super().__init__()
        self.input_files, self.options, self.partitions = input_files, options, partitions
        self.errors_dir, self.path = errors_dir, path

    def expand(self, pbegin):
        threshold, errors_dir, path = self.options.arity_threshold, self.errors_dir, self.path
        chunks, _, _ = pbegin | "ReadRecords" >> ReadRecords(self.input_files, self.options.columns, errors_dir)
        return (
            chunks
            | "RecordPartitions" >> RecordPartitions(self.partitions)
            | "CountGroups" >> beam.MapTuple(lambda _, chunks: _group_sizes(chunks, errors_dir, threshold))
            | "Total" >> beam.CombineGlobally(lambda sizes: tuple(map(sum, zip(*sizes))) if sizes else (0, 0))
            | "WriteSizes" >> beam.Map(lambda sizes: files.write_bytes(path, json.dumps(list(sizes)).encode()))
        )


def _group_sizes(chunks, errors_dir: str, threshold: int) -> tuple[int, int]:
    """A record partition's records with at most `threshold` users and with more."""
    with keeping_input_errors(errors_dir):  # ids of two types in two files
        return group_sizes(rec.merged_records(chunks, rec.Rejects()).arity, threshold)


def _count_groups(
    input_files: list[str], options: BoundOptions, partitions: int, beam_options, run_dir: str
) -> BoundOptions:
    """One pipeline run that counts the two groups of --order alternate (their sizes place the runs)."""
    path, errors_dir = storage.join(run_dir, "group-sizes.json"), storage.join(run_dir, "input-errors")
    pipeline = beam.Pipeline(options=beam_options)
    _ = pipeline | "CountGroups" >> GroupSizes(input_files, options, partitions, errors_dir, path)
    run(pipeline, NAMESPACE, errors_dir, run_dir)
    small, large = json.loads(files.read_bytes(path))
    log.info("--order alternate: %d records with at most %d users, %d with more", small, options.arity_threshold, large)
    return dataclasses.replace(options, group_sizes=(small, large))


class _PipelineRuns(NamedTuple):
    """What the pipeline runs of a bound leave: the last run's summary (the selection's counts and the
    algorithm's state), each run's statistics, the algorithm's control after the last, and the input's rejects."""

    summary: PipelineRunSummary
    runs: list[dict]
    control: Control
    rejects: rec.Rejects


def _run_pipelines(
    input_files: list[str],
    output: str,
    options: BoundOptions,
    ours: MadpPipelineOptions,
    beam_options: PipelineOptions,
    capacities: Capacities | None,
    work: str,
    invocation: str,
) -> _PipelineRuns:
    """Pipeline runs until the algorithm is done (typically one), each resuming from the state the one
    before saved in `work` (under the name of this `invocation`); an input error leaves no partial
    selection and no work files."""
    control, resume_from = Control(options.duplicates, options.max_rounds), None
    runs: list[dict] = []
    while True:
        run_dir = storage.join(work, f"{invocation}-run-{len(runs):04d}")
        log.info("pipeline run %d, from round %d", len(runs) + 1, len(control.per_round) + 1)
        pipeline = beam.Pipeline(options=beam_options)
        _ = pipeline | "Bound" >> BoundPipeline(
            input_files,
            output,
            options,
            ours.partitions,
            ours.rounds_per_pipeline,
            ours.local_finish_incidences,
            capacities,
            control,
            run_dir,
            resume_from,
        )
        try:
            counters = run(pipeline, NAMESPACE, storage.join(run_dir, "input-errors"), output)
            summary = PipelineRunSummary.from_json(json.loads(files.read_bytes(storage.join(run_dir, SUMMARY))))
            if not runs:  # every run reads the same input: the first one's rejects are all of them
                rejects = rec.Rejects.from_jsonl(files.read_bytes(storage.join(run_dir, REJECTED)).decode())
                handle_rejects(rejects, options.on_invalid, output)  # under error, the run stopped on them
        except InputError:
            prepare_output(output)  # no partial selection outlives an error
            storage.remove_tree(work)
            raise
        rounds_before, control, counts = len(control.per_round), summary.control, summary.counts
        control.log_rounds(rounds_before)
        runs.append({**counts.run_figures(summary.iterations(ours.rounds_per_pipeline)), "beam_counters": counters})
        if control.next == DONE:
            break
        resume_from = storage.join(run_dir, "state")
    return _PipelineRuns(summary, runs, control, rejects)


def run_beam(input_path: str, output: str, options: BoundOptions, beam_args: list[str]) -> BoundReport:
    """`madp bound --runner <Beam runner>`: pipeline runs until the algorithm is done (typically one)."""
    beam_options = pipeline_options(beam_args)
    ours = madp_options(beam_options)
    prepare_runner(beam_options)
    started = time.perf_counter()
    input_files = rec.list_input_files(input_path)
    capacities = read_capacities(options.capacities, options.max_contributions) if options.capacities else None
    # Before the earlier selection goes: the first input file's record columns and, against the capacities,
    # its user ids' type. What the pipeline meets in reading all of it (an invalid row, another file's
    # columns or types) stops the run with no selection, so that none of an earlier input outlives it.
    users = record_reading.leading_facts(input_files[0], options.columns).user_type
    if capacities is not None and users is not None:
        capacities.typed_as(users)
    work = storage.join(output, WORK_DIR)
    storage.remove_tree(work)
    prepare_output(output)
    invocation = uuid.uuid4().hex[:12]  # a run's files never meet an earlier invocation's
    if options.order == "alternate":
        options = _count_groups(
            input_files, options, ours.partitions, beam_options, storage.join(work, f"{invocation}-groups")
        )
    summary, runs, control, rejects = _run_pipelines(
        input_files, output, options, ours, beam_options, capacities, work, invocation
    )
    shards = options.shards(summary.counts.input_records)  # as the pipeline counted them
    write_missing_shards(output, shards)
    runner = beam_options.view_as(StandardOptions).runner
    manifest = selection_manifest(output, shards)
    report = partitioned_bound_report(
        options, runner, input_path, summary.stats, rejects, control, manifest, ours.partitions, runs
    )
    storage.remove_tree(work)
    write_report(output, report)
    return dataclasses.replace(report, wall_time_s=round(time.perf_counter() - started, 3))
