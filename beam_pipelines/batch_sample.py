"""Batching on Beam, the sampling steps: Alg. 3's samples with p known (a side input), in parallel
form (no loop over steps).

record partitions (sample steps) -> user partitions (blocked (user, step))
-> record partitions (survivors) -> batch files (their rows)

Every element carries its arrays, keyed by the partition or batch file that receives them; the
survivors' join is a CoGroupByKey of each record partition with its samples and their exclusions.
"""

from __future__ import annotations

from collections.abc import Iterable

import apache_beam as beam
import numpy as np

from madp.beam.batch_join import summary_value
from madp.beam.pipeline import count
from madp.core import batch_files
from madp.core.batch_steps import (
    JoinedPartition,
    SampledIncidences,
    Samples,
    Units,
    block_users,
    gathered_file_rows,
    rows_of_file,
    sample_partition,
    survivors,
    units_of,
)
from madp.engines.batching import BatchOptions

FileRowsOf = tuple[int, tuple[int, batch_files.FileRows]]  # (batch file, (record partition, its rows there))


def _units(element: tuple[int, JoinedPartition]) -> tuple[int, Units]:
    part, partition = element
    return part, units_of(partition)


@beam.typehints.with_input_types(tuple[int, Units], float)
@beam.typehints.with_output_types(tuple[int, Samples])
class _SamplePartition(beam.DoFn):
    """Alg. 3 line 3 for a record partition; each sample's users go to their user partitions
    (`batch_steps.sample_partition`)."""

    def __init__(self, options: BatchOptions, partitions: int):
        self.options, self.partitions = options, partitions

    def process(self, element, probability: float):
        part, units = element
        sampled = sample_partition(part, units, probability, self.options.sampled_steps, self.partitions)
        count("units", sampled.units)
        count("sampled_unit_steps", sampled.sampled_unit_steps)
        yield part, sampled.samples
        for incidences in sampled.incidences:
            yield beam.pvalue.TaggedOutput("incidences", incidences)


@beam.typehints.with_input_types(tuple[int, Iterable[SampledIncidences]])
@beam.typehints.with_output_types(tuple[int, np.ndarray])
class _BlockUsers(beam.DoFn):
    """Alg. 3 line 4 within a user partition; excluded samples go back to their record partitions
    (`batch_steps.block_users`)."""

    def __init__(self, min_sep: int):
        self.min_sep = min_sep

    def process(self, element):
        _, pieces = element
        yield from block_users(pieces, self.min_sep)


@beam.typehints.with_output_types(FileRowsOf)
class _Survivors(beam.DoFn):
    """Alg. 3 line 5 for a record partition; survivors after warm-up go to their batch files, but for
    the rows of records with invalid content (`--on-invalid skip`), which were sampled like any
    (`batch_steps.survivors`)."""

    def __init__(self, options: BatchOptions):
        self.options = options

    def process(self, element):
        part, ((partition,), (samples,), excluded) = element
        options = self.options
        kept = survivors(partition, samples, excluded, options.warm_up_steps, options.steps, options.output_shards)
        count("excluded_by_min_sep", kept.excluded)
        yield summary_value("sampled_sizes", kept.sampled_sizes)
        for file in range(options.output_shards):  # every file hears from every partition, so empty files are written
            yield file, (part, rows_of_file(partition, kept.written, file))


def _file_rows(element: tuple[int, Iterable[tuple[int, batch_files.FileRows]]]) -> tuple[int, batch_files.FileRows]:
    """A batch file's rows from every record partition, as one FileRows (`batch_steps.gathered_file_rows`)."""
    file, by_partition = element
    return file, gathered_file_rows(by_partition)


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
        survived = (
            # per record partition: (its JoinedPartition, its Samples, its excluded samples from each user partition)
            (joined, sampled.samples, excluded)
            | "GroupSamplesByRecord" >> beam.CoGroupByKey()
            | "DropExcluded" >> beam.ParDo(_Survivors(options)).with_outputs("stats", main="rows")
        )
        rows = (
            survived.rows
            | "GroupRowsByFile" >> beam.GroupByKey()
            | "GatherFileRows" >> beam.Map(_file_rows).with_output_types(tuple[int, batch_files.FileRows])
        )
        return rows, survived.stats
