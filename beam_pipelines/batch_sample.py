"""Batching on Beam, the sampling steps: Alg. 3's samples with p known (a side input), in parallel
form (no loop over steps).

record partitions (sample steps) -> user partitions (blocked (user, step))
-> record partitions (survivors) -> batch files (their rows)
"""

from __future__ import annotations

import apache_beam as beam
import numpy as np
import pyarrow as pa

from beam_pipelines.batch_join import summary_value, user_partition_of
from beam_pipelines.pipeline import Sent, Stored, by_kind, count
from beam_pipelines.store import PartitionStore, stack
from madp.core import batch_files, sampling
from madp.engines.batching import BatchOptions, writable_rows


@beam.typehints.with_input_types(Stored, float)
class _SamplePartition(beam.DoFn):
    """Alg. 3 line 3 for a record partition; each sample's users go to their user partitions."""

    def __init__(self, options: BatchOptions, partitions: int, store: PartitionStore):
        self.options, self.partitions, self.store = options, partitions, store

    def process(self, element, probability: float):
        part, path = element
        yield part, ("partition", path)
        partition = self.store.read_arrays(path)
        record_of_unit, keys = sampling.unit_keys(partition["record_keys"], partition["copies"])
        unit, step = sampling.sampled_steps(keys, probability, self.options.sampled_steps)
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

    def __init__(self, min_sep: int, store: PartitionStore):
        self.min_sep, self.store = min_sep, store

    def process(self, element):
        user_part, handles = element
        pieces = self.store.gather(handles)
        users = stack(pieces, 0)
        steps = stack(pieces, 1)
        samples = stack(pieces, 2)
        source = np.concatenate([np.full(len(p[0]), p[3], np.int64) for p in pieces])
        blocked = sampling.blocked_user_steps(users, steps, self.min_sep)
        excluded_samples, excluded_source = samples[blocked], source[blocked]
        for part, handle in self.store.write_split(
            f"excluded-{user_part:05d}.store", excluded_source, lambda mask: excluded_samples[mask]
        ):
            yield part, ("excluded", handle)


@beam.typehints.with_output_types(Sent)
class _Survivors(beam.DoFn):
    """Alg. 3 line 5 for a record partition; survivors after warm-up go to their batch files, but for
    the rows of records with invalid content (`--on-invalid skip`), which were sampled like any."""

    def __init__(self, options: BatchOptions, store: PartitionStore):
        self.options, self.store = options, store

    def process(self, element):
        part, values = element
        handles = by_kind(values)
        samples = self.store.read_arrays(handles["samples"][0])
        survive = np.ones(len(samples["step"]), dtype=bool)
        for excluded in self.store.gather(handles.get("excluded", [])):
            survive[excluded] = False
        count("excluded_by_min_sep", int((~survive).sum()))
        record, keys, step = samples["record"][survive], samples["keys"][survive], samples["step"][survive]
        warm_up, steps, files = self.options.warm_up_steps, self.options.steps, self.options.output_shards
        yield summary_value("sampled_sizes", np.bincount(step, minlength=self.options.sampled_steps))
        partition = self.store.read_arrays(handles["partition"][0])
        # After warm-up, the rows of records with valid content (the others were sampled and excluded like any).
        kept = (step >= warm_up) & writable_rows(partition["valid"], record)
        record, keys, step = record[kept], keys[kept], step[kept] - warm_up
        file_of_row = batch_files.file_of_step(step, steps, files)
        rows_by_file = {}
        for file in range(files):  # every file hears from every partition, so empty files are written
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


@beam.typehints.with_input_types(Stored)
@beam.typehints.with_output_types(tuple[int, batch_files.FileRows])
class SampleBatches(beam.PTransform):
    """Stored record partitions (partition, handle) -> (batch file index, FileRows), and the realized
    size of every step as summary values; p comes as a singleton PCollection (a side input)."""

    def __init__(self, options: BatchOptions, partitions: int, store: PartitionStore, probability: beam.PCollection):
        super().__init__()
        self.options, self.partitions, self.store, self.probability = options, partitions, store, probability

    def expand(self, partition_handles):
        options, store = self.options, self.store
        sampled = partition_handles | "SampleSteps" >> beam.ParDo(
            _SamplePartition(options, self.partitions, store), beam.pvalue.AsSingleton(self.probability)
        ).with_outputs("incidences", main="samples")
        excluded = (
            sampled.incidences
            | "GroupSampledUsers" >> beam.GroupByKey()
            | "BlockUsers" >> beam.ParDo(_BlockUsers(options.min_sep, store))
        )
        survivors = (
            (sampled.samples, excluded)
            | "SamplesAndExclusions" >> beam.Flatten()
            | "GroupSamplesByRecord" >> beam.GroupByKey()
            | "DropExcluded" >> beam.ParDo(_Survivors(options, store)).with_outputs("stats", main="rows")
        )
        rows = (
            survivors.rows
            | "GroupRowsByFile" >> beam.GroupByKey()
            | "GatherFileRows"
            >> beam.MapTuple(lambda file, handles: (file, _concat_rows(store.gather(handles)))).with_output_types(
                tuple[int, batch_files.FileRows]
            )
        )
        return rows, survivors.stats
