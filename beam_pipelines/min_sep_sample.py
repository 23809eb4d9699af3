"""Batch materialization on Beam as one composite transform: records and their selection in, the
rows of each batch file out (b-min-sep Poisson sampling, Alg. 3).

`MinSepSample` takes (file index, RecordChunk with content) elements, as `record_chunks.ReadRecords`
or `RecordsFromRows` (with a content extractor) make them, or with `RecordExtractors` one's own
rows (any elements), which it reads with `RecordsFromRows`, and (shard, table of id and copies)
elements, as `BoundContributions` gives them. It joins them, counts units by |N(e)|, calibrates p on
that histogram in the graph (a side input of the sampling, so one pipeline run does it all), samples,
excludes, and gives (batch file index, FileRows) elements for the I/O to order, truncate, pad and
write (`batch_files.write_batch_file`), with the content's description, the rows it rejected (a
dead-letter output, for the caller to write under `--on-invalid skip`) and summary values: the
histogram, p, the records joined, the realized sizes per step. Under `--on-invalid error` a row it
rejected, or one of `rejected_before` (rows dropped upstream, as in reading), stops the run before
any sampling; with `errors_dir`, an InputError a step meets (this one included) is also kept there
for the driver (`pipeline.run`). Elements carry the partitions' arrays themselves, keyed by record
or user partition; no partition state is written to files.
"""

from __future__ import annotations

import typing

import apache_beam as beam
from apache_beam.typehints.decorators import IOTypeHints

from madp.beam.batch_join import JoinSelection, NeighbourhoodHistogram
from madp.beam.batch_sample import SampleBatches
from madp.beam.pipeline import Chunk, SelectionTable, StopOnInvalidRows, keeping_input_errors
from madp.beam.record_chunks import RecordExtractors, RecordsFromRows
from madp.core.errors import InputError
from madp.core.graph_digest import GraphDigest
from madp.engines.batching import BatchOptions, BoundGraph, calibrated_probability, check_same_graph


class SampledBatches(typing.NamedTuple):
    """What `MinSepSample` gives: each batch file's rows, and what the sampling found.

    Args:
        rows: (batch file index, FileRows) elements, every file of the options.
        content: one {column: Feature} dict, the content's description (the batches' schema).
        rejects: the `Rejects` of rows dropped here (duplicated ids, invalid content under skip).
        stats: (name, value) elements for the report.

    Returns:
        A NamedTuple of those PCollections (unpack it, or read its fields by name).

    Raises:
        Nothing: the pipeline raises what its steps meet.

    Example::

        batches = (records, selection) | MinSepSample(BatchOptions(steps=1000, batch_size=256, min_sep=8), 64)
        _ = batches.rows | beam.MapTuple(lambda index, rows: write_my_file(index, rows))
    """

    rows: beam.PCollection  # (batch file index, FileRows), every file of the options
    content: beam.PCollection  # one {column: Feature}: the content's description
    rejects: beam.PCollection  # Rejects of rows dropped here (duplicated ids, invalid content under skip)
    stats: beam.PCollection  # (name, value) for the report


def _calibrated(histogram: dict, options: BatchOptions, errors_dir: str | None) -> float:
    """p for the target expected batch size, on the |N(e)| histogram of all units."""
    with keeping_input_errors(errors_dir):  # no record, or a batch size above the units
        return calibrated_probability(histogram, options)


def _same_graph(histogram: dict, digest: GraphDigest, bound: BoundGraph, data: str, errors_dir: str | None) -> dict:
    """The histogram, once the records' graph digest is the bound's (else the run stops, the error kept)."""
    with keeping_input_errors(errors_dir):
        check_same_graph(digest, bound, data)
    return histogram


class MinSepSample(beam.PTransform):
    """b-min-sep Poisson sampling as one transform: (records, selection) -> SampledBatches, each batch
    file's rows, the content's description, the rows rejected here and the summary values. The records
    are (file index, RecordChunk) elements, or with `extractors` one's own rows, whose content is
    `content_extractor`'s (the batch files' columns besides id, step and weight). p is calibrated on the
    units' `|N(e)|` histogram in the same pipeline, and the sampling takes it as a side input.

    Args:
        options: the batching's options (`madp.engines.batching.BatchOptions`, sampler "minsep"): steps,
            batch_size, min_sep, max_batch_size, seed (None: a fresh secret key), ...
        partitions: record and user partitions.
        rejected_before: `Rejects` of rows dropped upstream.
        data: the records' name in errors.
        output: the output's name in errors (where on_invalid "skip" puts rejected rows).
        bound: a `madp bound` output's graph (`batching.bound_graph`): records whose graph is not the
            bounded one stop the run before p is calibrated; a selection made in the same pipeline needs
            no such check.
        errors_dir: where an InputError a step meets is kept for the driver (`pipeline.run`).
        extractors: `RecordExtractors` with a content_extractor, to read records out of one's own rows.

    Returns:
        Applied to (records, selection), where the selection is (shard, table of id and copies) elements
        as `BoundSelection.shards` gives them, a `SampledBatches`.

    Raises:
        ValueError: a sampler other than "minsep".
        madp.core.errors.InputError: extractors without a content_extractor; in the pipeline, invalid
            rows (on_invalid "error"), another graph than `bound`, a batch size the units cannot reach.

    Example::

        chunks, rejects, _ = pipeline | ReadRecords(paths, Columns(), content=OTHER_COLUMNS)
        bound = chunks | BoundContributions(BoundOptions(max_contributions=4), partitions=64)
        batches = (chunks, bound.shards) | MinSepSample(BatchOptions(steps=1000, batch_size=256, min_sep=8), 64)
    """

    def __init__(
        self,
        options: BatchOptions,
        partitions: int,
        rejected_before: beam.PCollection | None = None,
        data: str = "the records",
        output: str = "OUTPUT",
        bound: BoundGraph | None = None,
        errors_dir: str | None = None,
        extractors: RecordExtractors | None = None,
    ):
        super().__init__()
        if options.sampler != "minsep":
            raise ValueError(f"MinSepSample runs --sampler minsep, not {options.sampler}")
        if extractors is not None and extractors.content_extractor is None:
            raise InputError(
                "MinSepSample writes each record's content to the batch files: give RecordExtractors.content_extractor"
            )
        self.options, self.partitions, self.rejected_before = options, partitions, rejected_before
        self.data, self.output, self.bound, self.errors_dir = data, output, bound, errors_dir
        self.extractors = extractors

    def default_type_hints(self) -> IOTypeHints:
        return IOTypeHints.empty().with_input_types(Chunk if self.extractors is None else typing.Any, SelectionTable)

    def expand(self, inputs) -> SampledBatches:
        options, partitions, errors_dir = self.options, self.partitions, self.errors_dir
        records, selection = inputs
        earlier, read = [] if self.rejected_before is None else [self.rejected_before], []
        if self.extractors is not None:
            # (chunk index, RecordChunk with content) of the rows' valid records; the other rows' Rejects
            records, read_rejects, read_stats = records | "RecordsFromRows" >> RecordsFromRows(
                self.extractors, partitions, errors_dir
            )
            earlier.append(read_rejects)
            read.append(read_stats)
        joined = (records, selection) | "JoinSelection" >> JoinSelection(options, self.data, partitions, errors_dir)
        # (record partition, JoinedPartition), (user partition, Incidences), and the join's by-products
        partitions_joined, incidences, content, rejects, join_stats, digest = joined
        # One {|N(e)|: units} dict.
        histogram = incidences | "NeighbourhoodHistogram" >> NeighbourhoodHistogram(partitions)
        if self.bound is not None:  # the records must be the graph bounded: stop before calibrating and sampling
            histogram = histogram | "SameGraphAsBound" >> beam.Map(
                _same_graph, beam.pvalue.AsSingleton(digest), self.bound, self.data, errors_dir
            )
        # One float: p.
        probability = histogram | "CalibrateP" >> beam.Map(_calibrated, options, errors_dir)
        if options.on_invalid == "error":  # the gate is on p, a single value: no data waits on it
            probability = probability | "StopOnInvalidRows" >> StopOnInvalidRows(
                (rejects, *earlier), self.output, errors_dir
            )
        # (batch file index, FileRows), and (name, value) summary values
        rows, sample_stats = partitions_joined | "SampleBatches" >> SampleBatches(options, partitions, probability)
        named = (
            histogram | "NamedHistogram" >> beam.Map(lambda h: ("histogram", h)),
            probability | "NamedProbability" >> beam.Map(lambda p: ("probability", p)),
        )
        stats = (*read, join_stats, sample_stats, *named) | "SampleStats" >> beam.Flatten()
        if self.extractors is not None:  # the rows it read itself: their rejects are its own
            rejects = (read_rejects, rejects) | "AllRejects" >> beam.Flatten()
        return SampledBatches(rows, content, rejects, stats)
