"""Contribution bounding on Beam as one composite transform: records in, their selection out.

`BoundContributions` takes (file index, RecordChunk) elements, as `record_chunks.ReadRecords` or
`RecordsFromRows` make them (after the rules over the whole input: one id type, ...), or with
`RecordExtractors` one's own rows (any elements), which it reads with `RecordsFromRows`, and gives a
`BoundSelection`: (output shard, table of id and copies) elements and the number of shards (one
element), the rejected duplicated ids, the
counts, and the final `bounding.Control` (one element: rounds, passes, whether it converged). All
state travels through the graph as elements (`bound_build`, `bound_rounds`); a step writes no file
but the continuation below.

It unrolls `rounds` iterations of Alg. 1 (a round, or a pass start with `--duplicates`); once the
undecided incidences left number at most `local_finish_incidences`, one worker finishes them with the
local kernels. Should neither happen within the iterations, the selection made so far is written
under `state_dir` through Beam's FileSystems and the Control says what is left (`next` is not
"done"): `madp bound` (`madp.beam.bound`) then runs the pipeline again from there, with that
Control and `resume_from` the last run's `state_dir`. The bound holds whatever happens: a record
still undecided is not selected. Under `--on-invalid error`, a duplicated id or a row of
`rejected_before` (rows dropped upstream, as in reading) stops the run before the first round.
"""

from __future__ import annotations

import typing
from typing import Any

import apache_beam as beam
import pyarrow as pa
from apache_beam.typehints.decorators import IOTypeHints

from madp.beam import files
from madp.beam.bound_build import BuildSides, state_path
from madp.beam.bound_rounds import DONE, AfterLastRound, FinishLocally, FirstSaturation, Iteration, Progress
from madp.beam.pipeline import Chunk, StopOnInvalidRows, stat
from madp.beam.record_chunks import RecordExtractors, RecordsFromRows
from madp.core import storage
from madp.core.bound_steps import finish_record_partition
from madp.core.bounding import Capacities, Control
from madp.core.errors import InputError
from madp.core.routing import by_kind
from madp.core.selection import BoundOptions

RECORDS, SELECTED = "records", "selected"


class BoundSelection(typing.NamedTuple):
    """What `BoundContributions` gives: the selection's shards and what the bounding counted.

    Args:
        shards: (output shard, pyarrow table of id and copies) elements, every shard at least once; none
            until the algorithm is done (`control`).
        shard_count: one int, the output shards.
        rejects: the `Rejects` of duplicated ids (with extractors, of rows that are not valid records).
        stats: (name, count) elements, to be summed (`max_` ones maxed).
        control: one `madp.core.bounding.Control`: the rounds and passes run, and what is left.

    Returns:
        A NamedTuple of those PCollections (unpack it, or read its fields by name).

    Raises:
        Nothing: the pipeline raises what its steps meet.

    Example::

        bound = chunks | BoundContributions(BoundOptions(max_contributions=4), partitions=64)
        _ = bound.shards | beam.MapTuple(lambda shard, table: write_my_shard(shard, table))
    """

    shards: beam.PCollection  # (output shard, table of id and copies), every shard at least once; none until done
    shard_count: beam.PCollection  # one int: the output shards (`BoundOptions.shards` of the valid input records)
    rejects: beam.PCollection  # Rejects of duplicated ids (and with extractors, of rows that are not valid records)
    stats: beam.PCollection  # (name, count): summed over elements, "max_" ones maxed
    control: beam.PCollection  # one bounding.Control: the algorithm's rounds and what is left


@beam.typehints.with_output_types(tuple[int, pa.Table])
class _FinishRecords(beam.DoFn):
    """A record partition's selection: its records' copies from the selections of every round; its
    shards of the output, its counts, and (when the algorithm is not done) the selection so far for
    the next pipeline run."""

    def __init__(self, state_dir: str | None, passes_at_start: int):
        self.state_dir, self.passes_at_start = state_dir, passes_at_start

    def process(self, element, control: Control, shards: int):
        part, values = element
        grouped = by_kind(values)
        (records,) = grouped[RECORDS]
        finished = finish_record_partition(records, grouped.get(SELECTED, []), control, self.passes_at_start, shards)
        if control.next != DONE and self.state_dir is not None:
            copies, in_pass = finished.selection
            table = pa.table({"key": records.keys, "copies": copies, "in_pass": in_pass})
            files.write_whole(state_path(self.state_dir, part), lambda handle: storage.parquet_to(handle, table))
        yield from (stat(name, count) for name, count in finished.counted.items())
        for name, count in finished.distribution.items():
            yield beam.pvalue.TaggedOutput("stats", (name, count))  # summed into histograms; no Beam counter each
        yield from finished.shards.items()  # none until done: the next pipeline run writes the selection


class BoundContributions(beam.PTransform):
    """Contribution bounding as one transform: (file index, RecordChunk) -> BoundSelection, or with
    `extractors` one's own rows -> BoundSelection; the module's description gives the contract.

    Args:
        options: the bounding's options (`madp.core.selection.BoundOptions`: max_contributions, order,
            seed, duplicates, ...); `group_sizes` set where order is "alternate".
        partitions: record and user partitions (several per worker core).
        rounds: iterations unrolled in this pipeline.
        local_finish_incidences: one worker finishes once at most this many undecided incidences are left.
        capacities: per-user bounds overriding max_contributions (`madp.core.bounding.Capacities`).
        control: where an earlier run of the pipeline stopped (None: from the start).
        resume_from: that run's `state_dir`.
        state_dir: where the selection so far is written should the rounds not finish here.
        rejected_before: `Rejects` of rows dropped upstream (on_invalid "error" stops on any).
        output: the output's name in errors.
        errors_dir: where an InputError a step meets is kept for the driver.
        extractors: `RecordExtractors` to read records out of one's own rows (None: the input is chunks).

    Returns:
        Applied to its input, a `BoundSelection`.

    Raises:
        madp.core.errors.InputError: order "alternate" without group_sizes, order "weight" with
            extractors that give no weight; in the pipeline, what the input's rules refuse.

    Examples, in a pipeline of one's own::

        chunks, read_rejects, _ = pipeline | ReadRecords(paths, Columns())
        bound = chunks | BoundContributions(BoundOptions(max_contributions=4), partitions=64)
        _ = bound.shards | beam.MapTuple(my_writer)

        rows = pipeline | beam.io.ReadFromBigQuery(table="project:dataset.emails")
        extractors = RecordExtractors(lambda row: row["message_id"], lambda row: [row["sender"], *row["recipients"]])
        bound = rows | BoundContributions(BoundOptions(max_contributions=4), extractors=extractors)
    """

    def __init__(
        self,
        options: BoundOptions,
        partitions: int = 64,
        rounds: int = 10,
        local_finish_incidences: int = 2_000_000,
        capacities: Capacities | None = None,
        control: Control | None = None,
        resume_from: str | None = None,
        state_dir: str | None = None,
        rejected_before: beam.PCollection | None = None,
        output: str = "OUTPUT",
        errors_dir: str | None = None,
        extractors: RecordExtractors | None = None,
    ):
        super().__init__()
        if options.order == "alternate" and options.group_sizes is None:
            raise InputError("--order alternate needs the sizes of its two groups first (BoundOptions.group_sizes)")
        if extractors is not None and options.order == "weight" and extractors.weight_extractor is None:
            raise InputError("order weight orders by each record's weight: give RecordExtractors.weight_extractor")
        self.options, self.partitions, self.rounds = options, partitions, rounds
        self.threshold, self.capacities = local_finish_incidences, capacities
        self.control = control or Control(options.duplicates, options.max_rounds)
        self.resume_from, self.state_dir = resume_from, state_dir
        self.rejected_before, self.output, self.errors_dir = rejected_before, output, errors_dir
        self.extractors = extractors

    def default_type_hints(self) -> IOTypeHints:
        return IOTypeHints.empty().with_input_types(Chunk if self.extractors is None else typing.Any)

    def expand(self, inputs) -> BoundSelection:
        chunks, earlier, stats = inputs, [] if self.rejected_before is None else [self.rejected_before], []
        if self.extractors is not None:
            # (chunk index, RecordChunk) of the rows' valid records; the other rows' Rejects. Without
            # their content, as madp bound reads files: content must not decide which records are kept.
            chunks, read_rejects, read_stats = inputs | "RecordsFromRows" >> RecordsFromRows(
                self.extractors._replace(content_extractor=None), self.partitions, self.errors_dir
            )
            earlier.append(read_rejects)
            stats.append(read_stats)
        users, records, duplicates, counts, build_stats = chunks | "BuildSides" >> BuildSides(
            self.options,
            self.partitions,
            self.capacities,
            self.resume_from,
            self.errors_dir,
        )
        # One Progress: where the algorithm starts; every later step reads it, so a gate on it stops the run.
        start = chunks.pipeline | "Start" >> beam.Create([Progress(self.control)])
        if self.options.on_invalid == "error":  # before any round
            start = start | "StopOnInvalidRows" >> StopOnInvalidRows(
                (duplicates, *earlier), self.output, self.errors_dir
            )
        saturate = self.capacities is not None or self.resume_from is not None or not self.options.duplicates
        users, progress, first_stats = (users, counts, start) | "FirstSaturation" >> FirstSaturation(
            self.control, self.threshold, saturate
        )
        selections, handed = [], []
        stats.extend((build_stats, first_stats))
        for iteration in range(1, self.rounds + 1):
            users, progress, selected, finish, iteration_stats = (users, progress) | f"Round{iteration}" >> Iteration(
                iteration, self.options.duplicates, self.threshold
            )
            selections.append(selected)
            handed.append(finish)
            stats.append(iteration_stats)
        finish, last_stats = (users, progress) | "AfterLastRound" >> AfterLastRound()
        stats.append(last_stats)
        # one Control: the local finish hears the last progress whether or not it finishes
        finished, control, finish_stats = progress | "FinishLocally" >> FinishLocally((*handed, finish))
        stats.append(finish_stats)
        # (record partition, (RECORDS, RecordPartition) or (SELECTED, SelectedKeys))
        tagged: list[Any] = [records | "TagRecords" >> beam.MapTuple(lambda part, r: (part, (RECORDS, r)))]
        tagged.extend(
            selected | f"TagSelected{index}" >> beam.MapTuple(lambda part, s: (part, (SELECTED, s)))
            for index, selected in enumerate([*selections, finished])
        )
        options = self.options
        shard_count = (
            build_stats
            | "InputRecords" >> beam.FlatMapTuple(lambda name, count: [count] if name == "input_records" else [])
            | "CountInputRecords" >> beam.CombineGlobally(sum)
            | "ShardCount" >> beam.Map(options.shards)
        )
        joined = (
            tagged
            | "MeetSelections" >> beam.Flatten()
            | "JoinSelections" >> beam.GroupByKey()
            | "FinishRecords"
            >> beam.ParDo(
                _FinishRecords(self.state_dir, self.control.passes),
                beam.pvalue.AsSingleton(control),
                beam.pvalue.AsSingleton(shard_count),
            ).with_outputs("stats", main="shards")
        )
        stats.append(joined.stats)
        rejects = duplicates
        if self.extractors is not None:  # the rows it read itself: their rejects are its own
            rejects = (read_rejects, duplicates) | "AllRejects" >> beam.Flatten()
        stats = tuple(stats) | "AllStats" >> beam.Flatten()
        return BoundSelection(joined.shards, shard_count, rejects, stats, control)
