"""Batching on Beam, second run: Alg. 3's samples with p known, in parallel form (no loop over steps).

record partitions (sample steps) -> user partitions (blocked (user, step))
-> record partitions (survivors) -> files (order, truncate, pad, write)
-> user / record partitions (participation statistics)
"""

from __future__ import annotations

import dataclasses

import apache_beam as beam
import numpy as np
import pyarrow as pa

from beam_pipelines.batch_prepare import count, record_partition_of, summary_value, user_partition_of
from beam_pipelines.pipeline import by_kind
from beam_pipelines.store import PartitionStore, stack
from madp.core import batch_files, sampling
from madp.engines import batch_report


@dataclasses.dataclass(frozen=True)
class SamplePlan:
    probability: float
    total_steps: int
    warm_up: int
    steps: int
    min_sep: int
    files: int
    max_batch_size: int | None
    output: str
    shapes: dict


class _SamplePartition(beam.DoFn):
    """Alg. 3 line 3 for a record partition; each sample's users go to their user partitions."""

    def __init__(self, plan: SamplePlan, partitions: int, store: PartitionStore):
        self.plan, self.partitions, self.store = plan, partitions, store

    def process(self, element):
        part, path = element
        partition = self.store.read_arrays(path)
        record_of_unit, keys = sampling.unit_keys(partition["record_keys"], partition["copies"])
        unit, step = sampling.sampled_steps(keys, self.plan.probability, self.plan.total_steps)
        record = record_of_unit[unit]
        count("units", len(keys))
        count("sampled_unit_steps", len(unit))
        yield (
            part,
            (
                "samples",
                self.store.write_arrays(
                    f"samples-{part:05d}.store", {"record": record, "keys": keys[unit], "step": step}
                ),
            ),
        )
        owner, flat = batch_files.incidences_of(partition["offsets"], record)
        users = partition["users"][flat]
        for user_part, handle in self.store.write_split(
            f"sampled-users-{part:05d}.store",
            user_partition_of(users, self.partitions),
            lambda mask: (users[mask], step[owner[mask]], owner[mask], part),
        ):
            yield beam.pvalue.TaggedOutput("incidences", (user_part, handle))


class _BlockUsers(beam.DoFn):
    """Alg. 3 line 4 within a user partition; excluded samples go back to their record partitions."""

    def __init__(self, plan: SamplePlan, store: PartitionStore):
        self.plan, self.store = plan, store

    def process(self, element):
        user_part, handles = element
        pieces = self.store.gather(handles)
        users = stack(pieces, 0)
        steps = stack(pieces, 1)
        samples = stack(pieces, 2)
        source = np.concatenate([np.full(len(p[0]), p[3], np.int64) for p in pieces])
        blocked = sampling.blocked_user_steps(users, steps, self.plan.min_sep)
        excluded_samples, excluded_source = samples[blocked], source[blocked]
        for part, handle in self.store.write_split(
            f"excluded-{user_part:05d}.store", excluded_source, lambda mask: excluded_samples[mask]
        ):
            yield part, ("excluded", handle)


class _Survivors(beam.DoFn):
    """Alg. 3 line 5 for a record partition; survivors after warm-up go to their batch files."""

    def __init__(self, plan: SamplePlan, partition_paths: dict[int, str], store: PartitionStore):
        self.plan, self.partition_paths, self.store = plan, partition_paths, store

    def process(self, element):
        part, values = element
        handles = by_kind(values)
        if "samples" not in handles:
            return
        samples = self.store.read_arrays(handles["samples"][0])
        survive = np.ones(len(samples["step"]), dtype=bool)
        for excluded in self.store.gather(handles.get("excluded", [])):
            survive[excluded] = False
        count("excluded_by_min_sep", int((~survive).sum()))
        record, keys, step = samples["record"][survive], samples["keys"][survive], samples["step"][survive]
        yield summary_value("sampled_sizes", np.bincount(step, minlength=self.plan.total_steps))
        real = step >= self.plan.warm_up
        record, keys, step = record[real], keys[real], step[real] - self.plan.warm_up
        partition = self.store.read_arrays(self.partition_paths[part])
        file_of_row = batch_files.file_of_step(step, self.plan.steps, self.plan.files)
        rows_by_file = {}
        for file in range(self.plan.files):  # every file hears from every partition, so empty files are written
            mine = np.flatnonzero(file_of_row == file)
            rows_by_file[file] = batch_files.file_rows(
                partition["ids"],
                partition["content"],
                partition["offsets"],
                partition["users"],
                partition["record_keys"],
                record[mine],
                keys[mine],
                step[mine],
            )
        yield from self.store.write_slices(f"rows-{part:05d}.store", rows_by_file).items()


def _concat_rows(pieces: list[batch_files.FileRows]) -> batch_files.FileRows:
    base = np.cumsum([0] + [int(p.user_offsets[-1]) for p in pieces[:-1]])
    return batch_files.FileRows(
        steps=np.concatenate([p.steps for p in pieces]),
        unit_keys=np.concatenate([p.unit_keys for p in pieces]),
        record_keys=np.concatenate([p.record_keys for p in pieces]),
        ids=pa.concat_arrays([p.ids for p in pieces]),
        content=pa.concat_tables([p.content for p in pieces]),
        user_offsets=np.concatenate([[0]] + [p.user_offsets[1:] + b for p, b in zip(pieces, base)]).astype(np.int64),
        users=np.concatenate([p.users for p in pieces]),
    )


class _WriteFile(beam.DoFn):
    """Order, truncate, pad and write one batch file; written rows go on to the statistics."""

    def __init__(self, plan: SamplePlan, partitions: int, store: PartitionStore):
        self.plan, self.partitions, self.store = plan, partitions, store

    def process(self, element):
        file, handles = element
        rows = _concat_rows(self.store.gather(handles))
        result = batch_files.write_batch_file(
            batch_files.batch_file_path(self.plan.output, file, self.plan.files),
            rows,
            batch_files.step_range(file, self.plan.steps, self.plan.files),
            self.plan.max_batch_size,
            self.plan.shapes,
        )
        count("written_rows", int(result["written"].sum()))
        count("truncated_rows", result["truncated"])
        count("padding_rows", result["padding"])
        yield summary_value("file", (file, {k: result[k] for k in ("written", "truncated", "padding")}))
        users, steps, records = result["user_hashes"], result["user_steps"], result["record_keys"]
        for user_part, handle in self.store.write_split(
            f"written-users-{file:05d}.store",
            user_partition_of(users, self.partitions),
            lambda mask: (users[mask], steps[mask]),
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


class SamplePipeline(beam.PTransform):
    """Sample, exclude, write the batch files, and gather the report's statistics."""

    def __init__(self, plan: SamplePlan, partition_paths: dict[int, str], partitions: int, store: PartitionStore):
        super().__init__()
        self.plan, self.partition_paths, self.partitions, self.store = plan, partition_paths, partitions, store

    def expand(self, pbegin):
        plan, store, partitions = self.plan, self.store, self.partitions
        sampled = (
            pbegin
            | "ListPartitions" >> beam.Create(sorted(self.partition_paths.items()))
            | "SpreadPartitions" >> beam.Reshuffle()
            | "SampleSteps"
            >> beam.ParDo(_SamplePartition(plan, partitions, store)).with_outputs("incidences", main="samples")
        )
        excluded = (
            sampled.incidences
            | "GroupSampledUsers" >> beam.GroupByKey()
            | "BlockUsers" >> beam.ParDo(_BlockUsers(plan, store))
        )
        survivors = (
            (sampled.samples, excluded)
            | "SamplesAndExclusions" >> beam.Flatten()
            | "GroupSamplesByRecord" >> beam.GroupByKey()
            | "DropExcluded"
            >> beam.ParDo(_Survivors(plan, self.partition_paths, store)).with_outputs("stats", main="rows")
        )
        written = (
            survivors.rows
            | "GroupRowsByFile" >> beam.GroupByKey()
            | "WriteBatchFiles"
            >> beam.ParDo(_WriteFile(plan, partitions, store)).with_outputs("users", "records", "stats", main="unused")
        )
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
        return (
            (survivors.stats, written.stats, participation, records)
            | "SampleSummary" >> beam.Flatten()
            | "CollectSample" >> beam.combiners.ToList()
            | "WriteSample" >> beam.Map(lambda items: store.write_arrays("sample-summary.store", items))
        )
