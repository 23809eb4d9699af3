"""Contribution bounding on Beam as one composite transform: records in, their selection out.

`BoundContributions` takes (file index, RecordChunk) elements, as `record_chunks.ReadRecords` or
`record_reading.read_file` make them, and gives (output shard, table of id and copies) elements, the
rejected duplicated ids and the counts. It unrolls `rounds` rounds of Alg. 1 (one pass over the
capacities); a record still undecided after them is not selected, so the bound holds whatever
`rounds` is, and the counts say how many were left (`round_{rounds}_eligible`). Under `--on-invalid
error` a duplicated id, or a row of `rejected_before` (rows dropped upstream, as in reading), stops
the run before the first round. Its partition state lives in a `SideStore` whose directory every
worker reaches.

A pipeline of one's own embeds it as it is. `madp bound` (`beam_pipelines.bound`) adds the I/O and
chains runs of it, each continuing from the last one's saved selection, until the algorithm converges,
with further passes for `--duplicates`.
"""

from __future__ import annotations

import apache_beam as beam
import numpy as np
import pyarrow as pa
from apache_beam.metrics import Metrics

from beam_pipelines.bound_build import BuildSides
from beam_pipelines.bound_rounds import ProposalRound, Saturate, SideStore
from beam_pipelines.pipeline import NAMESPACE, Chunk, StopOnInvalidRows, stat
from beam_pipelines.store import PartitionStore
from madp.core import storage
from madp.core.errors import InputError
from madp.core.selection import BoundOptions, record_distribution_stats, selection_shards, user_distribution_stats


@beam.typehints.with_input_types(Chunk)
class BoundContributions(beam.PTransform):
    """(file index, RecordChunk) -> (output shard, selection table); rejected duplicated ids; (name, count)."""

    def __init__(
        self,
        options: BoundOptions,
        partitions: int,
        rounds: int,
        store: SideStore,
        state_dir: str | None = None,
        continues: bool = False,
        new_pass: bool = False,
        rejected_before: beam.PCollection | None = None,
        output: str = "OUTPUT",
    ):
        super().__init__()
        if options.order == "alternate" and options.group_sizes is None:
            raise InputError("--order alternate needs the sizes of its two groups first (BoundOptions.group_sizes)")
        self.options, self.partitions, self.rounds, self.store = options, partitions, rounds, store
        self.state_dir, self.continues, self.new_pass = state_dir, continues, new_pass
        self.rejected_before, self.output = rejected_before, output

    def expand(self, chunks):
        store = self.store
        restore = self.state_dir if self.continues else None
        users, records, rejects, build_stats = chunks | "BuildSides" >> BuildSides(
            self.options, self.partitions, store, restore, self.new_pass
        )
        if self.options.on_invalid == "error":  # before any round; the users' handles are small
            earlier = () if self.rejected_before is None else (self.rejected_before,)
            users = users | "StopOnInvalidRows" >> StopOnInvalidRows((rejects, *earlier), self.output, store.directory)
        no_messages = chunks.pipeline | "NoAcceptedYet" >> beam.Create([])
        users, setup_stats = (users, no_messages) | "SaturateInitially" >> Saturate(store, 0)
        stats = [build_stats, setup_stats]
        for round_index in range(1, self.rounds + 1):
            users, records, round_stats = (users, records) | f"Round{round_index}" >> ProposalRound(store, round_index)
            stats.extend(round_stats)
        stats.append(users | "UserStats" >> beam.FlatMap(_user_stats, store))
        finished = records | "FinishRecords" >> beam.ParDo(
            _FinishRecords(store, self.state_dir, self.options.output_shards)
        ).with_outputs("stats", main="shards")
        stats.append(finished.stats)
        return finished.shards, rejects, tuple(stats) | "AllStats" >> beam.Flatten()


@beam.typehints.with_output_types(tuple[int, pa.Table])
class _FinishRecords(beam.DoFn):
    """Emit selection shards and counts; save the partial selection for a following pipeline run."""

    def __init__(self, store: SideStore, state_dir: str | None, shards: int):
        self.store, self.state_dir, self.shards = store, state_dir, shards

    def process(self, element):
        part, (_, handle) = element
        state = self.store.load("records", handle)
        if self.state_dir is not None:
            PartitionStore(self.state_dir).write_arrays(
                f"state-{part:05d}.store", {"keys": state.keys, "copies": state.copies, "in_pass": state.in_pass}
            )
        yield stat("selected_records", state.copies.sum())
        yield stat("distinct_selected", (state.copies > 0).sum())
        for name, count in record_distribution_stats(state.arity, state.copies).items():
            yield beam.pvalue.TaggedOutput("stats", (name, count))  # summed into histograms; no Beam counter each
        selected = state.copies > 0
        ids = self.store.read_arrays(storage.join(self.store.directory, f"records-{part:05d}-ids.store"))["ids"]
        # Empty tables too: they carry the id type, so a shard no partition fills is still typed right.
        yield from selection_shards(ids.filter(pa.array(selected)), state.copies[selected], self.shards).items()


def _user_stats(element, store: SideStore):
    _, (_, handle) = element
    side = store.load("users", handle)
    Metrics.counter(NAMESPACE, "input_users").inc(len(side.residual))
    Metrics.distribution(NAMESPACE, "user_contribution").update(int(side.contribution.max(initial=0)))
    yield "input_users", len(side.residual)
    yield "max_user_contribution", int(side.contribution.max(initial=0))
    yield from user_distribution_stats(
        np.bincount(side.inc_user, minlength=len(side.residual)), side.contribution
    ).items()
