"""Batching on Beam, the sampling steps: Alg. 3's samples with p known (a side input), in parallel
form (no loop over steps).

record partitions (sample steps) -> user partitions (blocked (user, step))
-> record partitions (survivors) -> batch files (their rows)

Every element carries its arrays, keyed by the partition or batch file that receives them; the
survivors' join is a CoGroupByKey of each record partition with its samples and their exclusions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import apache_beam as beam
import numpy as np
import pyarrow as pa

from madp.beam.batch_join import JoinedPartition, split_rows, summary_value, user_partition_of
from madp.beam.pipeline import count
from madp.core import batch_files, sampling
from madp.core.columnar import Columnar
from madp.engines.batching import BatchOptions, writable_rows


@dataclasses.dataclass(frozen=True)
class Units(Columnar):
    """What the sampling needs of a joined record partition: its records' keys and copies (its
    units) and their users (CSR), without the ids and content that only the survivors' rows need."""

    record_keys: np.ndarray
    copies: np.ndarray
    offsets: np.ndarray
    users: np.ndarray


def _units(element: tuple[int, JoinedPartition]) -> tuple[int, Units]:
    part, partition = element
    return part, Units(partition.record_keys, partition.copies, partition.offsets, partition.users)


@dataclasses.dataclass(frozen=True)
class Samples(Columnar):
    """A record partition's sampled (unit, step) pairs: the record index and unit key of each."""

    record: np.ndarray
    keys: np.ndarray
    step: np.ndarray


@dataclasses.dataclass(frozen=True)
class SampledIncidences(Columnar):
    """(user, step) incidences of a record partition's samples, sent to the user's partition."""

    source: int  # the record partition the samples are of
    users: np.ndarray
    steps: np.ndarray
    samples: np.ndarray  # index of each incidence's sample among its partition's Samples


FileRowsOf = tuple[int, tuple[int, batch_files.FileRows]]  # (batch file, (record partition, its rows there))


@beam.typehints.with_input_types(tuple[int, Units], float)
@beam.typehints.with_output_types(tuple[int, Samples])
class _SamplePartition(beam.DoFn):
    """Alg. 3 line 3 for a record partition; each sample's users go to their user partitions."""

    def __init__(self, options: BatchOptions, partitions: int):
        self.options, self.partitions = options, partitions

    def process(self, element, probability: float):
        part, units = element
        record_of_unit, keys = sampling.unit_keys(units.record_keys, units.copies)
        unit, step = sampling.sampled_steps(keys, probability, self.options.sampled_steps)
        record = record_of_unit[unit]
        count("units", len(keys))
        count("sampled_unit_steps", len(unit))
        yield part, Samples(record, keys[unit], step)
        owner, flat = batch_files.incidences_of(units.offsets, record)
        users = units.users[flat]
        for user_part, rows in split_rows(user_partition_of(users, self.partitions)):
            incidences = SampledIncidences(part, users[rows], step[owner[rows]], owner[rows])
            yield beam.pvalue.TaggedOutput("incidences", (user_part, incidences))


@beam.typehints.with_input_types(tuple[int, Iterable[SampledIncidences]])
@beam.typehints.with_output_types(tuple[int, np.ndarray])
class _BlockUsers(beam.DoFn):
    """Alg. 3 line 4 within a user partition; excluded samples go back to their record partitions."""

    def __init__(self, min_sep: int):
        self.min_sep = min_sep

    def process(self, element):
        _, pieces = element
        pieces = sorted(pieces, key=lambda p: p.source)  # one order, whatever order the runner delivered
        users = np.concatenate([p.users for p in pieces])
        steps = np.concatenate([p.steps for p in pieces])
        samples = np.concatenate([p.samples for p in pieces])
        source = np.concatenate([np.full(len(p.users), p.source, np.int64) for p in pieces])
        blocked = sampling.blocked_user_steps(users, steps, self.min_sep)
        excluded_samples, excluded_source = samples[blocked], source[blocked]
        for part, rows in split_rows(excluded_source):
            yield part, excluded_samples[rows]


@beam.typehints.with_output_types(FileRowsOf)
class _Survivors(beam.DoFn):
    """Alg. 3 line 5 for a record partition; survivors after warm-up go to their batch files, but for
    the rows of records with invalid content (`--on-invalid skip`), which were sampled like any."""

    def __init__(self, options: BatchOptions):
        self.options = options

    def process(self, element):
        part, grouped = element
        (partition,), (samples,) = grouped["partition"], grouped["samples"]
        survive = np.ones(len(samples.step), dtype=bool)
        for excluded in grouped["excluded"]:
            survive[excluded] = False
        count("excluded_by_min_sep", int((~survive).sum()))
        record, keys, step = samples.record[survive], samples.keys[survive], samples.step[survive]
        warm_up, steps, files = self.options.warm_up_steps, self.options.steps, self.options.output_shards
        yield summary_value("sampled_sizes", np.bincount(step, minlength=self.options.sampled_steps))
        # After warm-up, the rows of records with valid content (the others were sampled and excluded like any).
        kept = (step >= warm_up) & writable_rows(partition.valid, record)
        record, keys, step = record[kept], keys[kept], step[kept] - warm_up
        file_of_row = batch_files.file_of_step(step, steps, files)
        for file in range(files):  # every file hears from every partition, so empty files are written
            mine = np.flatnonzero(file_of_row == file)
            rows = batch_files.file_rows(
                partition.ids,
                partition.content,
                partition.offsets,
                partition.users,
                partition.record_keys,
                record[mine],
                keys[mine],
                step[mine],
            )
            yield file, (part, rows)


def _file_rows(element: tuple[int, Iterable[tuple[int, batch_files.FileRows]]]) -> tuple[int, batch_files.FileRows]:
    """A batch file's rows from every record partition, in partition order (whatever order the
    runner delivered them in), as one FileRows."""
    file, by_partition = element
    pieces = [rows for _, rows in sorted(by_partition, key=lambda item: item[0])]
    base = np.cumsum([0] + [int(p.user_offsets[-1]) for p in pieces[:-1]])
    return file, batch_files.FileRows(
        steps=np.concatenate([p.steps for p in pieces]),
        unit_keys=np.concatenate([p.unit_keys for p in pieces]),
        record_keys=np.concatenate([p.record_keys for p in pieces]),
        ids=pa.concat_arrays([p.ids for p in pieces]),
        content=pa.concat_tables([p.content for p in pieces]),
        user_offsets=np.concatenate([[0]] + [p.user_offsets[1:] + b for p, b in zip(pieces, base)]).astype(np.int64),
        users=np.concatenate([p.users for p in pieces]),
    )


@beam.typehints.with_input_types(tuple[int, JoinedPartition])
@beam.typehints.with_output_types(tuple[int, batch_files.FileRows])
class SampleBatches(beam.PTransform):
    """Joined record partitions (partition, JoinedPartition) -> (batch file index, FileRows), and the
    realized size of every step as summary values; p comes as a singleton PCollection (a side input)."""

    def __init__(self, options: BatchOptions, partitions: int, probability: beam.PCollection):
        super().__init__()
        self.options, self.partitions, self.probability = options, partitions, probability

    def expand(self, joined):
        options = self.options
        # (record partition, Samples); incidences: (user partition, SampledIncidences). Only the units
        # wait for p: the content goes straight to the survivors' join, so it crosses the runner once.
        sampled = (
            joined
            | "UnitsOfPartitions" >> beam.Map(_units).with_output_types(tuple[int, Units])
            | "SampleSteps"
            >> beam.ParDo(
                _SamplePartition(options, self.partitions), beam.pvalue.AsSingleton(self.probability)
            ).with_outputs("incidences", main="samples")
        )
        # (record partition, indices of its samples that min-sep excludes)
        excluded = (
            sampled.incidences
            | "GroupSampledUsers" >> beam.GroupByKey()
            | "BlockUsers" >> beam.ParDo(_BlockUsers(options.min_sep))
        )
        # (batch file, (record partition, FileRows of its surviving rows in the file))
        survivors = (
            {"partition": joined, "samples": sampled.samples, "excluded": excluded}
            | "GroupSamplesByRecord" >> beam.CoGroupByKey()
            | "DropExcluded" >> beam.ParDo(_Survivors(options)).with_outputs("stats", main="rows")
        )
        rows = (
            survivors.rows
            | "GroupRowsByFile" >> beam.GroupByKey()
            | "GatherFileRows" >> beam.Map(_file_rows).with_output_types(tuple[int, batch_files.FileRows])
        )
        return rows, survivors.stats
